"""maxmoe equals Hugging Face on tiny random DeepSeek-V3 / Mixtral / Qwen3-MoE models.

Reference: tests/fixtures/hf/<name>/ (tools/make_hf_fixtures.py: transformers 5.24, float32,
eager attention and experts), covering q-lora on/off, interleaved and rotate-half RoPE, YaRN
with different mscales, groups, shared experts, first-k / every-Nth / listed dense layers,
top-k renormalisation on/off and GQA with head_dim != hidden / heads. Tolerance: 1e-4 absolute
on logits of std ~1 (a correct float32 implementation is ~1e-6 off); same expert sets.
"""

from pathlib import Path

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxmoe.convert.from_hf import read_hf
from maxmoe.model.transformer import Transformer, layer_groups

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
NAMES = sorted(p.name for p in FIXTURES.iterdir())


def run_fixture(name: str):
    cfg, params, _, _ = read_hf(FIXTURES / name)
    model = nnx.eval_shape(lambda: Transformer(cfg.model, cfg.attention, cfg.moe, dtype=jnp.float32,
                                               rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(model)
    model = nnx.merge(graphdef, params)
    ids = np.load(FIXTURES / name / "input_ids.npy")
    segment_ids = np.ones_like(ids)
    positions = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    logits, aux = model(ids, segment_ids, positions)
    return cfg, np.asarray(logits), aux


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_experts_equal_hugging_face(name):
    assert len(NAMES) >= 6
    cfg, logits, aux = run_fixture(name)
    reference = np.load(FIXTURES / name / "logits.npy")
    diff = float(np.max(np.abs(logits - reference)))
    print(f"{name}: max |logit diff| = {diff:.2e}")
    assert diff < 1e-4
    picked = np.load(FIXTURES / name / "experts.npz")
    moe_layers = [first + j for is_moe, first, n in layer_groups(cfg.model) if is_moe
                  for j in range(n)]
    assert sorted(picked.files) == sorted(f"layer_{i}" for i in moe_layers)
    ours = np.asarray(aux["expert_idx"])  # [L_moe, B, S, K]
    for row, layer in enumerate(moe_layers):
        ref = np.sort(picked[f"layer_{layer}"], axis=-1)
        got = np.sort(ours[row].reshape(-1, ours.shape[-1]), axis=-1)
        np.testing.assert_array_equal(got, ref, err_msg=f"layer {layer}")
