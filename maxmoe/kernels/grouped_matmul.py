"""Grouped expert MLP on one device: the (token, k) assignments routed to a run of experts,
sorted by expert and run as one grouped matmul (SwiGLU), weighted and summed per token.

Two implementations of the grouped matmul, chosen by `moe.grouped_matmul`: `lax.ragged_dot`
(GPUs have a grouped GEMM) or `blocked`, `block_expert_mlp`, a loop over per-expert row blocks
with its own backward (XLA:CPU lowers ragged_dot densely); `auto` picks by platform. No
collectives here: parallel/experts.py moves tokens between expert shards and calls this.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from maxmoe.sharding import mesh_platform


def dropless_local(x, expert_idx, weights, w_gate, w_up, w_down, first_expert, *,
                   grouped_matmul: str = "auto", block_size: int = 0):
    """Runs experts [first_expert, first_expert + El) on the tokens routed to them.

    x [..., D] (T rows once flattened); expert_idx, weights [T, K] (global expert ids);
    w_gate, w_up [El, D, F]; w_down [El, F, D]. Returns [T, D] float32: the weighted sum over
    this shard's experts.
    grouped_matmul: "ragged_dot" (lax.ragged_dot over rows sorted by expert), "blocked"
    (rows sorted by expert, each expert padded to whole blocks of block_size rows, then
    `block_expert_mlp`, a loop over the blocks in use: the fast form on XLA:CPU) or "auto"
    (blocked on CPU, ragged_dot elsewhere; the current mesh's devices decide, see
    sharding.mesh_platform).
    """
    grouped_matmul = resolve_kernel(grouped_matmul)
    k, num_local = expert_idx.shape[1], w_gate.shape[0]
    scope = jax.named_scope  # the profile's MoE parts (blocked: no separate combine)
    if grouped_matmul == "blocked":
        with scope("dispatch"):
            token, row_weight, bounds = blocked_rows(expert_idx, weights, first_expert,
                                                     num_local, block_size)
        with scope("grouped_matmul"):  # gathers, weights and scatters block by block itself
            return block_expert_mlp(x, token, row_weight, w_gate, w_up, w_down, bounds)
    with scope("dispatch"):  # ragged_dot
        _, order, sizes = _by_expert(expert_idx, first_expert, num_local)
        x = x.reshape(-1, x.shape[-1])
        token = order // k
        xs = x[token]  # rows past sum(sizes) belong to other shards: ragged_dot gives zeros
    with scope("grouped_matmul"):
        h = (jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, sizes))
             * jax.lax.ragged_dot(xs, w_up, sizes))
        out = jax.lax.ragged_dot(h, w_down, sizes).astype(jnp.float32)
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


@jax.custom_vjp
def block_expert_mlp(x, token, row_weight, w_gate, w_up, w_down, bounds):
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
    """
    return _block_expert_mlp_fwd(x, token, row_weight, w_gate, w_up, w_down, bounds)[0]


def _block_expert_mlp_fwd(x, token, row_weight, w_gate, w_up, w_down, bounds):
    x, token, row_weight, w_gate, w_up, w_down, bounds = (
        jnp.asarray(a) for a in (x, token, row_weight, w_gate, w_up, w_down, bounds))
    res = (x, token, row_weight, w_gate, w_up, w_down, bounds)
    x = x.reshape(-1, x.shape[-1])
    f = w_down.shape[1]

    def expert(e, carry):
        wgu, wd = jnp.concatenate([w_gate[e], w_up[e]], axis=1), w_down[e]

        def block(i, m, y):
            tok, w = _rows(token, i, m), _rows(row_weight, i, m)[:, None]
            gu = x[tok] @ wgu
            h = jax.nn.silu(gu[:, :f]) * gu[:, f:]
            hw = (h * w).astype(x.dtype)
            return y.at[tok].add(jnp.dot(hw, wd, preferred_element_type=jnp.float32))
        return _over_blocks(bounds[e], bounds[e + 1], block, carry)
    y = jax.lax.fori_loop(0, w_down.shape[0], expert,
                          jnp.zeros((x.shape[0], w_down.shape[2]), jnp.float32))
    return y, res


def block_expert_mlp_accumulate(acc, gy, x, token, row_weight, w_gate, w_up, w_down, bounds):
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
            gu = (xi @ wgu).astype(jnp.float32)
            gate, up = gu[:, :f], gu[:, f:]
            sig = jax.nn.sigmoid(gate)
            act = gate * sig  # silu
            h = act * up
            dhw = jnp.dot(g, wd.T, preferred_element_type=jnp.float32)  # d(weighted h)
            drw = jax.lax.dynamic_update_slice_in_dim(
                drw, jnp.sum(dhw * h, axis=1).reshape(m, -1), i, 0)
            dh = dhw * w
            dgate = dh * up * (sig * (1 + gate * (1 - sig)))  # d silu = sig (1 + x (1 - sig))
            dgu = jnp.concatenate([dgate, dh * act], axis=1).astype(x.dtype)
            dx = dx.at[tok].add(jnp.dot(dgu, wgu.T, preferred_element_type=jnp.float32))
            # weight gradients sum over many blocks: added in place into float32 [E, ...]
            # accumulators whatever the dtype (no per-expert zero fill, add and copy-out)
            hw = (h * w).astype(x.dtype)
            gwgu = jnp.dot(xi.T, dgu, preferred_element_type=jnp.float32)
            return (dx, drw, dwg.at[e].add(gwgu[:, :f]), dwu.at[e].add(gwgu[:, f:]),
                    dwd.at[e].add(jnp.dot(hw.T, g, preferred_element_type=jnp.float32)))
        return _over_blocks(bounds[e], bounds[e + 1], block, carry)
    return jax.lax.fori_loop(0, w_down.shape[0], expert, tuple(acc))


def _block_expert_mlp_bwd(res, gy):
    x, token, row_weight, w_gate, w_up, w_down, bounds = res
    zeros = tuple(jnp.zeros((math.prod(x.shape[:-1]), x.shape[-1]) if a is x else a.shape,
                            jnp.float32) for a in (x, row_weight, w_gate, w_up, w_down))
    dx, drw, dwg, dwu, dwd = block_expert_mlp_accumulate(zeros, gy, *res)
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
