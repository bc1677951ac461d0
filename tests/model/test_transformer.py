"""Model-level invariants on one device, float32.

Reference for scan/remat: the same params run unrolled / without remat; tolerance 1e-6
(identical math, only XLA fusion differs). Reference for the MoE: a dense computation where
every expert processes every token and the output is masked by the router's top-k choice.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxmoe.model.moe import MoE
from maxmoe.model.transformer import build_model
from maxmoe.parallel.experts import routed_experts
from tests.helpers import random_batch, small_config, stacked


def _grads(cfg, batch):
    graphdef, variables = nnx.split(build_model(cfg, 0))
    params = nnx.to_pure_dict(variables)
    f = jax.jit(jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(batch)[0]))
    return f(params)


@pytest.fixture(scope="module")
def setup():
    cfg, _ = small_config("model.remat_policy=none")
    return cfg, random_batch(cfg)


@pytest.mark.parametrize("variant", [
    {"scan_layers": False},
    {"remat_policy": "full"},
    {"remat_policy": "dots"},
    {"remat_policy": "full", "scan_layers": False},
])
def test_scan_and_remat_give_equal_loss_and_grads(setup, variant):
    cfg, batch = setup
    ref_loss, ref = _grads(cfg, batch)
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **variant))
    loss, got = _grads(other, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    got = stacked(got)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("grouped_matmul", ["ragged_dot", "blocked"])
def test_dropless_moe_equals_dense_masked_reference(grouped_matmul):
    cfg, _ = small_config(f"moe.grouped_matmul={grouped_matmul}", "moe.block_size=16")
    moe = MoE(cfg.moe, 64, std=0.2, dtype=jnp.float32, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(0), (4, 16, 64))
    y, aux = moe(x)
    # dense reference: every expert on every token, weighted by the router's top-k choice
    logits = np.asarray(x).reshape(-1, 64) @ np.asarray(moe.router[...])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :2]
    mask = np.zeros_like(probs)
    np.put_along_axis(mask, top, 1.0, axis=-1)
    weights = probs * mask / (probs * mask).sum(-1, keepdims=True)
    xf = np.asarray(x).reshape(-1, 64).astype(np.float64)
    g, u, d = (np.asarray(p[...], np.float64) for p in (moe.gate, moe.up, moe.down))
    h = np.einsum("td,edf->etf", xf, g)
    h = h / (1 + np.exp(-h)) * np.einsum("td,edf->etf", xf, u)
    expert_out = np.einsum("etf,efd->etd", h, d)
    ref = np.einsum("te,etd->td", weights, expert_out)
    ref += np.asarray(moe.shared(x)).reshape(-1, 64)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 64), ref, rtol=1e-4, atol=1e-5)
    assert float(aux["expert_load"].sum()) == x.shape[0] * x.shape[1] * 2


def test_dropless_keeps_every_token_when_all_route_to_one_expert():
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    idx = jnp.zeros((2, 8, 2), jnp.int32).at[..., 1].set(1)  # all tokens to experts 0 and 1
    weights = jnp.ones((2, 8, 2)) * 0.5
    w = 0.3 * jax.random.normal(jax.random.key(2), (4, 16, 8))
    wd = 0.3 * jax.random.normal(jax.random.key(3), (4, 8, 16))
    y, stats = routed_experts(x, idx, weights, w, w, wd, small_config()[0].moe)
    assert float(stats["dropped_fraction"]) == 0.0
    h = lambda e: jax.nn.silu(x @ w[e]) * (x @ w[e]) @ wd[e]  # noqa: E731
    np.testing.assert_allclose(y, 0.5 * h(0) + 0.5 * h(1), rtol=1e-5, atol=1e-5)


def test_attention_never_crosses_documents():
    cfg, _ = small_config()
    model = build_model(cfg, 0)
    batch = random_batch(cfg, docs_per_row=2)
    logits, _ = model(batch["tokens"], batch["segment_ids"], batch["positions"])
    # change every token of the second document: logits of the first must not move
    changed = np.where(batch["segment_ids"] == 2, (batch["tokens"] + 7) % 256, batch["tokens"])
    logits2, _ = model(changed, batch["segment_ids"], batch["positions"])
    first = batch["segment_ids"] == 1
    np.testing.assert_array_equal(np.asarray(logits)[first], np.asarray(logits2)[first])
    assert not np.allclose(np.asarray(logits)[~first], np.asarray(logits2)[~first])


MLA = ["attention.kind=mla", "attention.kv_lora_rank=16", "attention.qk_nope_head_dim=8",
       "attention.qk_rope_head_dim=8", "attention.v_head_dim=8"]


@pytest.mark.parametrize("kind", ["gqa", "mla", "mla_wide_v"])
def test_fused_attention_equals_einsum(kind):
    """Reference: the einsum path; float32, tolerance 1e-5 on the logits and 1e-4 relative to
    each gradient's largest entry (same math, other kernel and backward). MLA's v is narrower
    than q.k (8 < 8 + 8): the fused kernel pads it; mla_wide_v pads q and k."""
    extra = {"gqa": [], "mla": MLA, "mla_wide_v": MLA + ["attention.v_head_dim=24"]}[kind]
    cfg, _ = small_config(*extra)
    fused_cfg, _ = small_config("attention.implementation=fused", *extra)
    batch = random_batch(cfg)
    args = batch["tokens"], batch["segment_ids"], batch["positions"]

    def logits_and_grads(model):
        loss = lambda m: jnp.mean(jax.nn.log_softmax(m(*args)[0])[..., 1])  # noqa: E731
        return model(*args)[0], nnx.grad(loss)(model)

    ref, ref_grads = logits_and_grads(build_model(cfg, 0))
    got, got_grads = logits_and_grads(build_model(fused_cfg, 0))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(r))))


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_causal_query_blocks_equal_one_block(kind):
    """Reference: the same model with one query block (causal_block_size=0); blocks of 12 rows
    over 32 positions (12 + 12 + 8, so the last is short) must give the same loss and grads.
    float32, rtol 1e-5: only the key range each softmax row spans differs (masked keys add
    exactly 0)."""
    extra = MLA if kind == "mla" else []
    cfg, _ = small_config("model.remat_policy=none", "attention.causal_block_size=0", *extra)
    blocked, _ = small_config("model.remat_policy=none", "attention.causal_block_size=12", *extra)
    batch = random_batch(cfg)
    ref_loss, ref = _grads(cfg, batch)
    loss, got = _grads(blocked, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lm_head_matmul_gradients_equal_autodiff(dtype):
    """lm_head_matmul's custom backward against autodiff of the same einsum (float32 logits);
    tolerance rtol 1e-5 in float32, 1e-2 in bfloat16 (one bf16 rounding of each gradient)."""
    from maxmoe.kernels.lm_loss import lm_head_matmul

    x = jax.random.normal(jax.random.key(0), (2, 5, 8)).astype(dtype)
    w = jax.random.normal(jax.random.key(1), (8, 11)).astype(dtype)
    g = jax.random.normal(jax.random.key(2), (2, 5, 11))

    def ref_fn(x, w):
        return jnp.einsum("bsd,dv->bsv", x, w, preferred_element_type=jnp.float32)

    ours, ours_vjp = jax.vjp(lm_head_matmul, x, w)
    ref, ref_vjp = jax.vjp(ref_fn, x, w)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(ours, ref, rtol=1e-6)
    for a, b in zip(ours_vjp(g), ref_vjp(g), strict=True):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_values_and_gradients_equal_float64_reference(dtype):
    """rms_norm's custom backward (keeps x and the reciprocal RMS, recomputes x / rms) against
    autodiff of scale * x / sqrt(mean(x^2) + eps) in float64. Tolerance: 1e-5 relative to each
    output's largest entry in float32; 2e-2 in bfloat16 (inputs and outputs rounded to bf16)."""
    from maxmoe.model.layers import rms_norm

    keys = jax.random.split(jax.random.key(0), 3)
    x = (3 * jax.random.normal(keys[0], (2, 5, 16))).astype(dtype)
    scale = 1 + jax.random.normal(keys[1], (16,))
    g = jax.random.normal(keys[2], (2, 5, 16)).astype(dtype)
    y, vjp = jax.vjp(lambda x, s: rms_norm(x, s, 1e-6), x, scale)
    ours = [y, *vjp(g)]

    def reference(x, s):
        return s * x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, scale, g)]
        ref, ref_vjp = jax.vjp(reference, *wide[:2])
        ref = [np.asarray(a) for a in (ref, *ref_vjp(wide[2]))]
    assert ours[0].dtype == ours[1].dtype == dtype and ours[2].dtype == jnp.float32
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for got, want in zip(ours, ref, strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float64), want,
                                   atol=tol * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("interleave", [False, True])
def test_rope_values_and_gradients_equal_float64_reference(interleave):
    """apply_rope (rotate_halves' backward is the rotation by -angle) against autodiff of the
    written-out rotation in float64: x1 cos - x2 sin, x2 cos + x1 sin over the halves (after
    de-interleaving pairs when asked), YaRN-scaled frequencies. atol 1e-5 (entries up to ~4)."""
    from maxmoe.config import AttentionConfig
    from maxmoe.model.rope import apply_rope, rope_frequencies

    cfg = AttentionConfig(rope_interleave=interleave, rope_scaling="yarn", rope_factor=4.0,
                          rope_original_max_positions=8)
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (2, 7, 3, 8))
    g = jax.random.normal(keys[1], (2, 7, 3, 8))
    positions = jnp.asarray([list(range(7)), [0, 1, 2, 0, 1, 2, 3]])
    y, vjp = jax.vjp(lambda x: apply_rope(x, positions, cfg), x)
    ours = [y, vjp(g)[0]]
    inv_freq, scale = rope_frequencies(cfg, 8)

    def reference(x):
        angles = positions[..., None, None] * inv_freq  # [B, S, 1, R/2]
        cos, sin = jnp.cos(angles) * scale, jnp.sin(angles) * scale
        if interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        x1, x2 = x[..., :4], x[..., 4:]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, g)]
        positions = jnp.asarray(np.asarray(positions, np.float64))
        inv_freq = np.asarray(inv_freq, np.float64)
        ref, ref_vjp = jax.vjp(reference, wide[0])
        ref = [np.asarray(a) for a in (ref, ref_vjp(wide[1])[0])]
    assert scale != 1.0
    for got, want in zip(ours, ref, strict=True):
        assert want.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rope_position_outside_the_sequence_gives_nan_not_a_wrong_angle():
    """apply_rope looks cos/sin up in a table of positions 0..S-1: a position outside it must
    poison its own row (NaN) and leave the others exact, never clamp to the last angle."""
    from maxmoe.config import AttentionConfig
    from maxmoe.model.rope import apply_rope

    cfg = AttentionConfig()
    x = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))
    good = apply_rope(x, jnp.asarray([[0, 1, 2, 3]]), cfg)
    bad = apply_rope(x, jnp.asarray([[0, 1, 4, 3]]), cfg)
    assert np.isnan(np.asarray(bad[0, 2])).all()
    np.testing.assert_array_equal(np.asarray(bad[0, [0, 1, 3]]), np.asarray(good[0, [0, 1, 3]]))
