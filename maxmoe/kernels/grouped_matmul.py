"""Grouped expert MLP on one device: the (token, k) assignments routed to a run of experts,
sorted by expert and run as one grouped matmul (SwiGLU), weighted and summed per token.

Two implementations of the grouped matmul, chosen by `moe.grouped_matmul`: `lax.ragged_dot`
(GPUs have a grouped GEMM) or `blocked`, `block_expert_mlp`, a loop over per-expert row blocks
with its own backward (XLA:CPU lowers ragged_dot densely); `auto` picks by platform. No
collectives here: parallel/experts.py moves tokens between expert shards and calls this.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from maxmoe.kernels.fp8 import fp8_matmul, quantize, round_trip_row_tiles
from maxmoe.sharding import mesh_platform


def dropless_local(x, expert_idx, weights, w_gate, w_up, w_down, first_expert, *,
                   grouped_matmul: str = "auto", block_size: int = 0, fp8: str = "none"):
    """Runs experts [first_expert, first_expert + El) on the tokens routed to them.

    x [..., D] (T rows once flattened); expert_idx, weights [T, K] (global expert ids);
    w_gate, w_up [El, D, F]; w_down [El, F, D]. Returns [T, D] float32: the weighted sum over
    this shard's experts.
    grouped_matmul: "ragged_dot" (lax.ragged_dot over rows sorted by expert), "blocked"
    (rows sorted by expert, each expert padded to whole blocks of block_size rows, then
    `block_expert_mlp`, a loop over the blocks in use: the fast form on XLA:CPU) or "auto"
    (blocked on CPU, ragged_dot elsewhere; the current mesh's devices decide, see
    sharding.mesh_platform).
    fp8: precision.fp8; tensorwise / blockwise run the expert GEMMs on E4M3 operands
    (kernels/fp8.py; ragged_dot: `fp8_ragged_dot`, blocked: inside `block_expert_mlp`).
    """
    grouped_matmul = resolve_kernel(grouped_matmul)
    k, num_local = expert_idx.shape[1], w_gate.shape[0]
    scope = jax.named_scope  # the profile's MoE parts (blocked: no separate combine)
    if grouped_matmul == "blocked":
        with scope("dispatch"):
            token, row_weight, bounds = blocked_rows(expert_idx, weights, first_expert,
                                                     num_local, block_size)
        with scope("grouped_matmul"):  # gathers, weights and scatters block by block itself
            return block_expert_mlp(x, token, row_weight, w_gate, w_up, w_down, bounds, fp8)
    with scope("dispatch"):  # ragged_dot
        _, order, sizes = _by_expert(expert_idx, first_expert, num_local)
        x = x.reshape(-1, x.shape[-1])
        token = order // k
        xs = x[token]  # rows past sum(sizes) belong to other shards: ragged_dot gives zeros
    with scope("grouped_matmul"):
        def mm(a, w):
            if fp8 == "none":
                return jax.lax.ragged_dot(a, w, sizes)
            return fp8_ragged_dot(a, w, sizes, fp8)
        h = jax.nn.silu(mm(xs, w_gate)) * mm(xs, w_up)
        out = mm(h, w_down).astype(jnp.float32)
    with scope("combine"):
        out = out * weights.reshape(-1)[order][:, None].astype(jnp.float32)
        # K contributions per token are summed in float32 before the cast back
        return jnp.zeros(x.shape, jnp.float32).at[token].add(out)


def resolve_kernel(grouped_matmul: str) -> str:
    """moe.grouped_matmul with auto resolved: blocked on CPU (XLA:CPU lowers ragged_dot
    densely), ragged_dot elsewhere (GPUs have a grouped GEMM); the current mesh's devices
    decide (sharding.mesh_platform)."""
    if grouped_matmul == "auto":
        return "blocked" if mesh_platform() == "cpu" else "ragged_dot"
    return grouped_matmul


def _by_expert(expert_idx, first_expert, num_local: int):
    """(key [T K]: local expert of each assignment, num_local for other shards' experts;
    order [T K]: the assignments sorted by key, stable; sizes [num_local]: rows per expert)."""
    local = expert_idx.reshape(-1) - first_expert  # [T*K]
    key = jnp.where((local >= 0) & (local < num_local), local, num_local)  # others last
    order = _stable_argsort(key, num_local + 1)
    sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    return key, order, sizes


def blocked_rows(expert_idx, weights, first_expert, num_local: int, block_size: int):
    """The row blocks `block_expert_mlp` runs: expert_idx, weights [T, K] (global expert ids)
    -> (token [N, bs] int32, row_weight [N, bs] float32, bounds [num_local + 1] int32), the
    assignments of experts [first_expert, first_expert + num_local) sorted by expert, each
    expert padded to whole blocks of block_size rows (0: auto, 16-128 rows)."""
    t, k = expert_idx.shape
    n = t * k
    key, order, sizes = _by_expert(expert_idx, first_expert, num_local)
    if block_size <= 0:  # auto: about a quarter of an even share per block, 16-128 rows
        block_size = int(min(128, max(16, 2 ** int(math.log2(max(n // (4 * num_local), 1))))))
    rows = -(-(n + num_local * (block_size - 1)) // block_size) * block_size  # worst case
    blocks = rows // block_size
    # slot of sorted row i of expert e = padded_start[e] + rank of i within e
    padded = (sizes + block_size - 1) // block_size * block_size
    padded_end = jnp.cumsum(padded)
    sorted_key = key[order]
    e = jnp.minimum(sorted_key, num_local - 1)
    rank = jnp.arange(n) - (jnp.cumsum(sizes) - sizes)[e]
    slot = jnp.where(sorted_key < num_local, padded_end[e] - padded[e] + rank, -1)
    assignment = jnp.full((rows,), n, jnp.int32).at[jnp.where(slot >= 0, slot, rows)].set(
        order, mode="drop")  # (token, k) assignment held by each slot; n = empty slot
    token = jnp.where(assignment < n, assignment // k, 0).reshape(blocks, block_size)
    row_weight = jnp.concatenate([weights.reshape(-1).astype(jnp.float32),
                                  jnp.zeros((1,), jnp.float32)])[assignment]
    row_weight = row_weight.reshape(blocks, block_size)
    bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), padded_end // block_size])
    return token, row_weight, bounds


def _stable_argsort(key, num_keys: int):
    """jnp.argsort(key, stable=True) for int keys in [0, num_keys): one sort of the single
    int32 key * n + index, which XLA:CPU runs faster than argsort's (key, index) pair sort with
    its comparator. Falls back to argsort where key * n + index would overflow int32."""
    n = key.shape[0]
    if num_keys * n >= 2 ** 31:
        return jnp.argsort(key, stable=True)
    return jnp.sort(key.astype(jnp.int32) * n + jnp.arange(n, dtype=jnp.int32)) % n


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def block_expert_mlp(x, token, row_weight, w_gate, w_up, w_down, bounds, fp8="none"):
    """Dispatch, SwiGLU expert MLP and weighted combine over row blocks grouped by expert:
    y[t] = sum over slots j with token[j] = t of row_weight[j] * expert_e(x[t]) for every
    slot of blocks bounds[e]:bounds[e+1] (expert e), expert_e(v) = (silu(v @ Wg[e]) *
    (v @ Wu[e])) @ Wd[e]. Blocks from bounds[-1] on are never visited.
    x [..., D], read as its T flattened rows (the caller's [B, S, D] array itself, so that the
    layer scan does not stack a reshaped copy of the router's input a second time as this
    kernel's residual); token [N, bs] int (an empty slot: any token with row_weight 0); row_weight
    [N, bs] float32; w_gate, w_up [E, D, F]; w_down [E, F, D]; bounds [E + 1] int,
    non-decreasing, bounds[0] = 0. Returns y [T, D] float32 (the K contributions per token
    summed in float32).

    A loop over experts around a loop over their blocks (GROUP blocks a step while that many
    remain, then one): each step gathers its blocks' token rows, runs the 2-D matmuls (gate | up
    joined) and scatter-adds the weighted output rows, so no [N * bs, D] copy of the inputs or
    outputs is made; weight gradients are added in place into float32 [E, ...] accumulators.
    The backward recomputes each block's gate/up matmul, so the kernel's residuals are its
    inputs and the layer scan stacks none of its activations. The router weight's gradient is
    rowsum(dL/d(weighted h) * h). Why this shape and not ragged_dot or a batched matmul:
    docs/performance.md, Grouped matmul.
    fp8 (precision.fp8): tensorwise / blockwise run every matmul of a step on E4M3 operands
    (kernels/fp8.fp8_matmul; gate and up quantised apart; the weight gradients' token tiles
    are the step's rows, 128 at a time, empty slots zeroed so they count in no tile's amax;
    tensorwise scales per step and per expert weight).
    """
    return _block_expert_mlp_fwd(x, token, row_weight, w_gate, w_up, w_down, bounds, fp8)[0]


def _mm(a, b, fp8: str, b_tile: int = 128):
    """a @ b with float32 accumulation: a plain dot (fp8 none) or fp8_matmul."""
    if fp8 == "none":
        return jnp.dot(a, b, preferred_element_type=jnp.float32)
    return fp8_matmul(a, b, fp8, b_tile)


def _gate_up(v, wgu, f: int, fp8: str):
    """v @ [Wg | Wu] in v's dtype; under fp8 the two weights are quantised apart."""
    if fp8 == "none":
        return v @ wgu
    return jnp.concatenate([_mm(v, wgu[:, :f], fp8), _mm(v, wgu[:, f:], fp8)], 1).astype(v.dtype)


def _block_expert_mlp_fwd(x, token, row_weight, w_gate, w_up, w_down, bounds, fp8="none"):
    x, token, row_weight, w_gate, w_up, w_down, bounds = (
        jnp.asarray(a) for a in (x, token, row_weight, w_gate, w_up, w_down, bounds))
    res = (x, token, row_weight, w_gate, w_up, w_down, bounds)
    x = x.reshape(-1, x.shape[-1])
    f = w_down.shape[1]

    def expert(e, carry):
        wgu, wd = jnp.concatenate([w_gate[e], w_up[e]], axis=1), w_down[e]

        def block(i, m, y):
            tok, w = _rows(token, i, m), _rows(row_weight, i, m)[:, None]
            gu = _gate_up(x[tok], wgu, f, fp8)
            h = jax.nn.silu(gu[:, :f]) * gu[:, f:]
            hw = (h * w).astype(x.dtype)
            return y.at[tok].add(_mm(hw, wd, fp8))
        return _over_blocks(bounds[e], bounds[e + 1], block, carry)
    y = jax.lax.fori_loop(0, w_down.shape[0], expert,
                          jnp.zeros((x.shape[0], w_down.shape[2]), jnp.float32))
    return y, res


def block_expert_mlp_accumulate(acc, gy, x, token, row_weight, w_gate, w_up, w_down, bounds,
                                fp8="none"):
    """block_expert_mlp's backward into float32 accumulators acc = (dx [T, D], d row_weight
    [N, bs], d w_gate, d w_up, d w_down) (their shapes as the inputs'): returns acc with the
    gradients added (d row_weight: set for the blocks in use, the rest kept). gy [T, D]: the output's cotangent. A caller that runs the kernel several
    times on the same weights (parallel/all_to_all.py's rounds) sums the weight gradients here,
    in place, instead of in a second weight-sized buffer."""
    x, gy = x.reshape(-1, x.shape[-1]), jnp.asarray(gy)
    f = w_down.shape[1]

    def expert(e, carry):
        wgu, wd = jnp.concatenate([w_gate[e], w_up[e]], axis=1), w_down[e]

        def block(i, m, carry):
            dx, drw, dwg, dwu, dwd = carry
            tok, w = _rows(token, i, m), _rows(row_weight, i, m)[:, None].astype(jnp.float32)
            g = gy[tok].astype(x.dtype)
            xi = x[tok]
            gu = _gate_up(xi, wgu, f, fp8).astype(jnp.float32)
            gate, up = gu[:, :f], gu[:, f:]
            sig = jax.nn.sigmoid(gate)
            act = gate * sig  # silu
            h = act * up
            dhw = _mm(g, wd.T, fp8)  # d(weighted h)
            drw = jax.lax.dynamic_update_slice_in_dim(
                drw, jnp.sum(dhw * h, axis=1).reshape(m, -1), i, 0)
            dh = dhw * w
            dgate = dh * up * (sig * (1 + gate * (1 - sig)))  # d silu = sig (1 + x (1 - sig))
            dgu = jnp.concatenate([dgate, dh * act], axis=1).astype(x.dtype)
            dx = dx.at[tok].add(_mm(dgu, wgu.T, fp8) if fp8 == "none" else
                                _mm(dgu[:, :f], wgu[:, :f].T, fp8)
                                + _mm(dgu[:, f:], wgu[:, f:].T, fp8))
            # weight gradients sum over many blocks: added in place into float32 [E, ...]
            # accumulators whatever the dtype (no per-expert zero fill, add and copy-out)
            hw = (h * w).astype(x.dtype)
            if fp8 != "none":  # empty slots (weight 0: dgu, hw rows 0) out of the tile amax
                xi, g = (jnp.where(w != 0, a, 0) for a in (xi, g))
            gwgu = _mm(xi.T, dgu, fp8, b_tile=1)  # fp8: 128x1 tiles along the rows
            return (dx, drw, dwg.at[e].add(gwgu[:, :f]), dwu.at[e].add(gwgu[:, f:]),
                    dwd.at[e].add(_mm(hw.T, g, fp8, b_tile=1)))
        return _over_blocks(bounds[e], bounds[e + 1], block, carry)
    return jax.lax.fori_loop(0, w_down.shape[0], expert, tuple(acc))


def _block_expert_mlp_bwd(fp8, res, gy):
    x, token, row_weight, w_gate, w_up, w_down, bounds = res
    zeros = tuple(jnp.zeros((math.prod(x.shape[:-1]), x.shape[-1]) if a is x else a.shape,
                            jnp.float32) for a in (x, row_weight, w_gate, w_up, w_down))
    dx, drw, dwg, dwu, dwd = block_expert_mlp_accumulate(zeros, gy, *res, fp8)
    return (dx.astype(x.dtype).reshape(x.shape), None, drw.astype(row_weight.dtype),
            dwg.astype(w_gate.dtype), dwu.astype(w_up.dtype), dwd.astype(w_down.dtype), None)


block_expert_mlp.defvjp(_block_expert_mlp_fwd, _block_expert_mlp_bwd)

# blocks per loop step: 4 blocks of 128 rows make 512-row matmuls, which XLA:CPU runs on both
# cores, and a quarter of the per-op overhead (docs/performance.md, Grouped matmul)
GROUP = 4


def _rows(a, i, m):
    """Blocks i:i+m of a [N, bs, ...] array as one [m * bs, ...] array."""
    part = jax.lax.dynamic_slice_in_dim(a, i, m)
    return part.reshape(-1, *a.shape[2:])


def _over_blocks(lo, hi, body, carry):
    """body(i, m, carry) over blocks lo:hi, m (static) blocks at a time: GROUP while that many
    remain, then one by one."""
    n = (hi - lo) // GROUP
    carry = jax.lax.fori_loop(0, n, lambda j, c: body(lo + j * GROUP, GROUP, c), carry)
    return jax.lax.fori_loop(lo + n * GROUP, hi, lambda i, c: body(i, 1, c), carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_ragged_dot(x, w, sizes, mode: str):
    """lax.ragged_dot(x [M, K], w [G, K, N], sizes [G]) -> [M, N] in x.dtype with E4M3
    operands (mode tensorwise: one scale for x, one per expert weight; blockwise: x in 1x128
    tiles, each expert's weight in 128x128 blocks, one 128-wide K block per ragged_dot, the
    partials scaled and summed in float32). The input gradient runs the same on g and w^T. The
    weight gradient quantises x and g along the tokens (128x1 tiles from each expert's first
    row, never spanning two experts; tensorwise: one scale; rows past sum(sizes) count in no
    amax) but contracts their dequantised float32 values (autodiff's ragged transpose of
    ragged_dot): the same values as an FP8 GEMM, not its speed."""
    return _ragged_fp8(x, w, sizes, mode).astype(x.dtype)


def _ragged_fp8(x, w, sizes, mode):
    """fp8_ragged_dot's product, float32 [M, N]."""
    m, (g, _, n) = x.shape[0], w.shape
    group = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(m), side="right"), g - 1)
    tile = None if mode == "tensorwise" else (1, 128)
    qx, sx = quantize(x, tile)
    qw, sw = jax.vmap(lambda a: quantize(a, None if tile is None else (128, 128)))(w)
    dot = lambda a, b: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32)  # noqa: E731
    if mode == "tensorwise":
        return dot(qx, qw) * sx[0, 0] * sw[group, 0, 0][:, None]
    sw = jnp.repeat(sw, 128, axis=2)[:, :, :n]  # [G, KB, N]
    y = jnp.zeros((m, n), jnp.float32)
    for i in range(sx.shape[1]):  # K blocks: a static, short loop (K / 128)
        part = dot(qx[:, i * 128:(i + 1) * 128], qw[:, i * 128:(i + 1) * 128])
        y = y + part * sx[:, i, None] * sw[group, i]
    return y


def _fp8_ragged_fwd(x, w, sizes, mode):
    return fp8_ragged_dot(x, w, sizes, mode), (x, w, sizes)


def _fp8_ragged_bwd(mode, res, g):
    x, w, sizes = res
    dx = _ragged_fp8(g, jnp.swapaxes(w, 1, 2), sizes, mode).astype(x.dtype)
    tile, num_tiles = _token_tiles(x.shape[0], sizes, mode)
    xd, gd = (round_trip_row_tiles(a, tile, num_tiles) for a in (x, g))
    _, pull = jax.vjp(lambda v: jax.lax.ragged_dot(xd, v, sizes,
                                                  preferred_element_type=jnp.float32),
                      w.astype(jnp.float32))
    return dx, pull(gd)[0].astype(w.dtype), None


def _token_tiles(m: int, sizes, mode: str):
    """(tile [M] int, num_tiles) of the weight gradient's token tiles over the grouped rows
    (kernels/fp8.round_trip_row_tiles): blockwise, 128 rows at a time from each group's first
    row (a tile never spans two experts); tensorwise, one tile. Rows past sum(sizes) (other
    shards' rows, which ragged_dot skips) get num_tiles: they count in no tile's amax."""
    ends = jnp.cumsum(sizes)
    row = jnp.arange(m)
    group = jnp.searchsorted(ends, row, side="right")  # len(sizes) past the last group
    live = group < sizes.shape[0]
    if mode == "tensorwise":
        return jnp.where(live, 0, 1), 1
    group = jnp.minimum(group, sizes.shape[0] - 1)
    per_group = (sizes + 127) // 128
    first = jnp.cumsum(per_group) - per_group  # each group's first tile
    num_tiles = m // 128 + sizes.shape[0]  # >= sum(ceil(sizes / 128))
    tile = first[group] + (row - (ends - sizes)[group]) // 128
    return jnp.where(live, tile, num_tiles), num_tiles


fp8_ragged_dot.defvjp(_fp8_ragged_fwd, _fp8_ragged_bwd)
