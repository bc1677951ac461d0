"""maxmoe equals Hugging Face on tiny random DeepSeek-V3/V2, Mixtral and Qwen3-MoE models.

Reference: tests/fixtures/hf/<name>/ (tools/make_hf_fixtures.py: transformers 5.24, float32,
eager attention and experts), covering q-lora on/off, interleaved and rotate-half RoPE, YaRN
with different mscales, sigmoid groups (top-2 sum) and softmax groups (best score, DeepSeek-V2
group_limited_greedy), greedy softmax top-k, routed scaling, shared experts, first-k /
every-Nth / listed dense layers, top-k renormalisation on/off (and DeepSeek-V2's ignored
norm_topk_prob) and GQA with head_dim != hidden / heads. Tolerance: 1e-4 absolute on logits of
std ~1 (a correct float32 implementation is ~1e-6 off); same expert sets. The HF -> maxmoe ->
HF round trip of every fixture is tests/convert/test_convert.py.
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxmoe.config_files import load_config
from maxmoe.convert.from_hf import read_hf
from maxmoe.hf.config import config_from_hf, config_to_hf, family_for
from maxmoe.hf.safetensors_io import ConversionError
from maxmoe.model.spec import layer_groups
from maxmoe.model.transformer import Transformer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
NAMES = sorted(p.name for p in FIXTURES.iterdir())
REQUIRED = {"deepseek_v3_qlora_interleave_yarn", "deepseek_v3_full_q_rotate_half",
            "deepseek_v3_groups_dense", "deepseek_v2_lite_greedy",
            "deepseek_v2_groups_qlora_scaled", "mixtral", "qwen3_moe_sparse_step",
            "qwen3_moe_mlp_only_yarn"}
PRESETS = Path(__file__).resolve().parents[2] / "configs" / "models"

# deepseek-ai/DeepSeek-V2-Lite config.json on the hub (all keys but the token ids and init range)
V2_LITE_HUB_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}


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
    assert REQUIRED <= set(NAMES)
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


def test_deepseek_v2_lite_hub_config_is_the_preset_both_ways():
    """The hub V2-Lite config.json reads as configs/models/deepseek_v2_lite.yaml (model,
    attention and moe sections equal field for field), and the preset writes back a config.json
    that reads the same and says what transformers and DeepSeek's code both compute."""
    preset, _ = load_config([str(PRESETS / "deepseek_v2_lite.yaml")])
    sections = lambda c: (c.model, c.attention, c.moe)  # noqa: E731
    assert sections(config_from_hf(V2_LITE_HUB_CONFIG)) == sections(preset)
    assert family_for(preset) == "deepseek_v2"
    written = config_to_hf(preset, V2_LITE_HUB_CONFIG, "bfloat16")
    assert sections(config_from_hf(written)) == sections(preset)
    assert written["architectures"] == ["DeepseekV2ForCausalLM"]
    assert {k: written[k] for k in ("topk_method", "n_group", "topk_group", "norm_topk_prob",
                                    "routed_scaling_factor", "scoring_func", "moe_layer_freq",
                                    "q_lora_rank", "num_key_value_heads")} == {
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "moe_layer_freq": 1,
        "q_lora_rank": None, "num_key_value_heads": 16}


@pytest.mark.parametrize("change, message", [
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"topk_method": "group_limited_greedy", "n_group": None}, "n_group"),
])
def test_deepseek_v2_config_that_transformers_would_compute_differently_is_refused(change, message):
    with pytest.raises(ConversionError, match=message):
        config_from_hf(dict(V2_LITE_HUB_CONFIG, **change))


@pytest.mark.parametrize("override", ["moe.normalize_top_k=true", "attention.rope_interleave=false",
                                      "model.mtp_depth=1"])
def test_mla_softmax_model_that_deepseek_v2_cannot_express_is_refused(override):
    cfg, _ = load_config([str(PRESETS / "deepseek_v2_lite.yaml")], [override])
    with pytest.raises(ConversionError, match="deepseek_v2|MTP"):
        family_for(cfg)
