"""The routed experts' grouped GEMM under precision.fp8 (tensorwise / blockwise), forward and
both gradients: `fp8_ragged_dot`, lax.ragged_dot on E4M3 operands (moe.grouped_matmul=
ragged_dot), and `dequantised_ragged_dot`, tokamax's bf16/f16 Mosaic grouped GEMM on the same
E4M3-rounded values (moe.grouped_matmul=tokamax: tokamax 0.0.17 has no FP8 ragged kernel for
SM90; docs/gpu_aot.md has the table of what it takes)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxmoe.kernels import tokamax_ops
from maxmoe.kernels.fp8 import (
    NO_AXES,
    AmaxAxes,
    expert_scales,
    quantize,
    quantize_whole,
    quantize_with,
    round_trip,
    round_trip_row_tiles,
    rounded_with,
    scale_of,
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fp8_ragged_dot(x, w, sizes, mode: str, amax: AmaxAxes = NO_AXES):
    """lax.ragged_dot(x [M, K], w [G, K, N], sizes [G]) -> [M, N] in x.dtype with E4M3
    operands (mode tensorwise: one scale for x over its sum(sizes) live rows and one per expert
    weight, reduced over amax's mesh axes; blockwise: x in 1x128 tiles, each expert's weight in
    128x128 blocks, one 128-wide K block per ragged_dot, the partials scaled and summed in
    float32). The input gradient runs the same on g and w^T. The weight gradient quantises x
    and g along the tokens (blockwise: 128x1 tiles from each expert's first row, never spanning
    two experts; tensorwise: one scale each; rows past sum(sizes) count in no amax) but
    contracts their dequantised float32 values (autodiff's ragged transpose of ragged_dot):
    the same values as an FP8 GEMM, not its speed."""
    return _ragged_fp8(x, w, sizes, mode, amax).astype(x.dtype)


def _live_rows(m: int, sizes):
    """[M, 1] bool: the rows ragged_dot reads (those before sum(sizes))."""
    return (jnp.arange(m) < jnp.sum(sizes))[:, None]


def _ragged_fp8(x, w, sizes, mode, amax):
    """fp8_ragged_dot's product, float32 [M, N]."""
    m, (g, _, n) = x.shape[0], w.shape
    group = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(m), side="right"), g - 1)
    dot = lambda a, b: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32)  # noqa: E731
    if mode == "tensorwise":
        qx, sx = quantize_whole(jnp.where(_live_rows(m, sizes), x, 0), amax.rows)
        sw = expert_scales(w, amax.weights)
        return dot(qx, quantize_with(w, sw[:, None, None])) * (sx * sw[group][:, None])
    qx, sx = quantize(x, (1, 128))
    qw, sw = jax.vmap(lambda a: quantize(a, (128, 128)))(w)
    sw = jnp.repeat(sw, 128, axis=2)[:, :, :n]  # [G, KB, N]
    y = jnp.zeros((m, n), jnp.float32)
    for i in range(sx.shape[1]):  # K blocks: a static, short loop (K / 128)
        part = dot(qx[:, i * 128:(i + 1) * 128], qw[:, i * 128:(i + 1) * 128])
        y = y + part * sx[:, i, None] * sw[group, i]
    return y


def _fp8_ragged_fwd(x, w, sizes, mode, amax):
    return fp8_ragged_dot(x, w, sizes, mode, amax), (x, w, sizes)


def _fp8_ragged_bwd(mode, amax, res, g):
    x, w, sizes = res
    dx = _ragged_fp8(g, jnp.swapaxes(w, 1, 2), sizes, mode, amax).astype(x.dtype)
    xd, gd = _token_rounded(x, g, sizes, mode, amax)
    _, pull = jax.vjp(lambda v: jax.lax.ragged_dot(xd, v, sizes,
                                                  preferred_element_type=jnp.float32),
                      w.astype(jnp.float32))
    return dx, pull(gd)[0].astype(w.dtype), None


def _token_rounded(x, g, sizes, mode, amax):
    """The weight gradient's operands x [M, K], g [M, N] rounded through E4M3 along the tokens
    (blockwise: 128x1 tiles from each expert's first row, never spanning two experts;
    tensorwise: one scale each, over amax.rows), float32; rows past sum(sizes) count in no
    amax."""
    if mode == "tensorwise":
        return tuple(_whole_rounded(a, sizes, amax) for a in (x, g))
    tile, num_tiles = _token_tiles(x.shape[0], sizes)
    return tuple(round_trip_row_tiles(a, tile, num_tiles) for a in (x, g))


def _whole_rounded(x, sizes, amax):
    """x [M, K] rounded through E4M3 with one scale over its rows before sum(sizes) (the amax
    reduced over amax.rows), float32; the other rows come back 0."""
    live = jnp.where(_live_rows(x.shape[0], sizes), x.astype(jnp.float32), 0.0)
    return rounded_with(live, scale_of(jnp.max(jnp.abs(live)), amax.rows))


def _token_tiles(m: int, sizes):
    """(tile [M] int, num_tiles) of the blockwise weight gradient's 128x1 token tiles over the
    grouped rows (kernels/fp8.round_trip_row_tiles): 128 rows at a time from each group's
    first row (a tile never spans two experts). Rows past sum(sizes) (other shards' rows,
    which ragged_dot skips) get num_tiles: they count in no tile's amax."""
    ends = jnp.cumsum(sizes)
    row = jnp.arange(m)
    group = jnp.searchsorted(ends, row, side="right")  # len(sizes) past the last group
    live = group < sizes.shape[0]
    group = jnp.minimum(group, sizes.shape[0] - 1)
    per_group = (sizes + 127) // 128
    first = jnp.cumsum(per_group) - per_group  # each group's first tile
    num_tiles = m // 128 + sizes.shape[0]  # >= sum(ceil(sizes / 128))
    tile = first[group] + (row - (ends - sizes)[group]) // 128
    return jnp.where(live, tile, num_tiles), num_tiles


fp8_ragged_dot.defvjp(_fp8_ragged_fwd, _fp8_ragged_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def dequantised_ragged_dot(x, w, sizes, mode: str, amax: AmaxAxes = NO_AXES):
    """fp8_ragged_dot's product, gradients and scales, each of the three GEMMs one tokamax
    Mosaic grouped kernel (tokamax_ops.grouped_*) in x's dtype (bfloat16/float16): every
    operand is quantised to E4M3 with the recipe's scales (x and g in 1x128 tiles, w in
    128x128 blocks, the weight gradient's x and g in 128x1 token tiles; tensorwise: one
    scale each) and dequantised back to x's dtype before the kernel (kernels/fp8.rounded_with:
    rounding that XLA:GPU keeps). So the values are the FP8 recipe's up to that 16-bit
    rounding of q * scale, the math is 16-bit on the tensor cores (not FP8 speed), and no
    GEMM expands densely. Residuals: x and w as given."""
    return _dequantised_fwd(x, w, sizes, mode, amax)[0]


def _rows_rounded(x, sizes, mode, amax):
    """x [M, K] (x or g) rounded through E4M3 along its rows, in x's dtype: 1x128 tiles, or
    tensorwise _whole_rounded."""
    if mode == "tensorwise":
        return _whole_rounded(x, sizes, amax).astype(x.dtype)
    return round_trip(x, (1, 128)).astype(x.dtype)


def _weights_rounded(w, mode, amax, dtype):
    """w [G, K, N] rounded through E4M3 in dtype: each expert's 128x128 blocks (blockwise; the
    same blocks serve w^T), or one scale per expert (tensorwise, over amax.weights)."""
    if mode == "tensorwise":
        return rounded_with(w, expert_scales(w, amax.weights)[:, None, None]).astype(dtype)
    return jax.vmap(lambda a: round_trip(a, (128, 128)).astype(dtype))(w)


def _dequantised_fwd(x, w, sizes, mode, amax):
    wr = _weights_rounded(w, mode, amax, x.dtype)
    return tokamax_ops.grouped_forward(_rows_rounded(x, sizes, mode, amax), wr, sizes), \
        (x, w, sizes)


def _dequantised_bwd(mode, amax, res, g):
    x, w, sizes = res
    g = g.astype(x.dtype)
    wr = _weights_rounded(w, mode, amax, x.dtype)  # recomputed: no 16-bit copy kept
    dx = tokamax_ops.grouped_input_grad(_rows_rounded(g, sizes, mode, amax), wr, sizes)
    xd, gd = (a.astype(x.dtype) for a in _token_rounded(x, g, sizes, mode, amax))
    return dx, tokamax_ops.grouped_weight_grad(xd, gd, sizes).astype(w.dtype), None


dequantised_ragged_dot.defvjp(_dequantised_fwd, _dequantised_bwd)
