"""Rotary position embedding: plain or YaRN-scaled frequencies, rotate-half or interleaved pairs.

The frequencies follow Hugging Face `modeling_rope_utils` (`default` and `yarn` rope types),
which is what the published DeepSeek-V3 / Qwen3 / Mixtral weights were trained with.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from maxmoe.config import AttentionConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction 0.1 * mscale * ln(factor) + 1 (1 if not scaled)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(cfg: AttentionConfig, dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] (float32) for a rotary head of size dim, and the cos/sin scale."""
    base = cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if cfg.rope_scaling == "none":
        return (1.0 / base).astype(np.float32), 1.0
    factor = cfg.rope_factor

    def correction_dim(rotations: float) -> float:  # the dim index that turns `rotations` times
        return (dim * math.log(cfg.rope_original_max_positions / (rotations * 2 * math.pi))
                / (2 * math.log(cfg.rope_theta)))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    # low dims (fast rotations) keep their frequency, high dims are interpolated by `factor`
    inv_freq = ramp / (factor * base) + (1.0 - ramp) / base
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        scale = yarn_mscale(factor, cfg.rope_mscale) / yarn_mscale(factor, cfg.rope_mscale_all_dim)
    else:
        scale = yarn_mscale(factor)
    return inv_freq.astype(np.float32), float(scale)


def apply_rope(x: jax.Array, positions: jax.Array, cfg: AttentionConfig,
               length: int | None = None) -> jax.Array:
    """x [B, S, N, R] (N heads, R rotary dims), positions [B, S] -> rotated x, same shape.
    length: the table's positions (default S; decoding passes its cache length, as one new
    token sits at a position beyond its own S = 1).

    Interleaved weights rotate pairs (2i, 2i+1); we de-interleave to (evens, odds) and rotate
    halves. The output stays de-interleaved: q and k get the same permutation, so q.k is unchanged.

    cos and sin come from a [S, R/2] table of positions 0..S-1, looked up by position (packed
    rows restart positions at each document, so they stay below S; one outside [0, S) gives
    NaN, never a silently wrong angle). cos(position * frequency) computed per token instead
    was fused by XLA into every q/k rotation of unrolled layers, re-evaluated per element
    (docs/performance/planning.md, Attention kernel).
    """
    inv_freq, scale = rope_frequencies(cfg, x.shape[-1])
    angles = jnp.arange(length or x.shape[1], dtype=jnp.float32)[:, None] * jnp.asarray(inv_freq)
    table = jnp.stack([jnp.cos(angles), jnp.sin(angles)]) * scale  # [2, S, R/2]
    cos, sin = jnp.take(table, positions, axis=1, mode="fill", fill_value=jnp.nan)[..., None, :]
    xf = x.astype(jnp.float32)
    if cfg.rope_interleave:
        xf = jnp.concatenate([xf[..., 0::2], xf[..., 1::2]], axis=-1)
    return rotate_halves(xf, cos, sin).astype(x.dtype)


@jax.custom_vjp
def rotate_halves(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin] over the last axis (halves x1, x2).

    A rotation, so its backward is the rotation by the opposite angle (sin negated), one fused
    pass. Autodiff of the slices and the concatenation instead padded each half of the
    gradient back to full width and added the two: three passes over q and k per layer in the
    backward. cos and sin come from integer positions: no gradient."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rotate_fwd(x, cos, sin):
    return rotate_halves(x, cos, sin), (cos, sin)


def _rotate_bwd(res, g):
    cos, sin = res
    return rotate_halves(g, cos, -sin), None, None


rotate_halves.defvjp(_rotate_fwd, _rotate_bwd)
