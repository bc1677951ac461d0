"""FP8 `lax.ragged_dot`: the grouped GEMM of kernels/grouped_matmul.py's ragged_dot path on
E4M3 operands (precision.fp8 tensorwise / blockwise), forward and both gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxmoe.kernels.fp8 import (
    NO_AXES,
    AmaxAxes,
    expert_scales,
    quantize,
    quantize_whole,
    quantize_with,
    round_trip_row_tiles,
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
    if mode == "tensorwise":
        live = _live_rows(x.shape[0], sizes)

        def round_trip(a):
            q, s = quantize_whole(jnp.where(live, a.astype(jnp.float32), 0.0), amax.rows)
            return q.astype(jnp.float32) * s
        xd, gd = round_trip(x), round_trip(g)
    else:
        tile, num_tiles = _token_tiles(x.shape[0], sizes)
        xd, gd = (round_trip_row_tiles(a, tile, num_tiles) for a in (x, g))
    _, pull = jax.vjp(lambda v: jax.lax.ragged_dot(xd, v, sizes,
                                                  preferred_element_type=jnp.float32),
                      w.astype(jnp.float32))
    return dx, pull(gd)[0].astype(w.dtype), None


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
