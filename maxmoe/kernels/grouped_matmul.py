"""Grouped expert MLP on one device: the (token, k) assignments routed to a run of experts,
sorted by expert and run as one grouped matmul (SwiGLU), weighted and summed per token.

Three implementations of the grouped matmul, chosen by `moe.grouped_matmul`: `tokamax`
(tokamax's Mosaic GPU grouped GEMM on NVIDIA GPUs, kernels/tokamax_ops.py), `lax.ragged_dot`
(which XLA:GPU and XLA:CPU expand densely) or `blocked`, `block_expert_mlp`, a loop over
per-expert row blocks with its own backward; `auto` picks by platform (resolve_kernel). Tokens do
not move here: parallel/experts.py moves them between expert shards and calls this (the one
collective is a scalar pmax of each tensorwise FP8 amax over kernels/fp8.AmaxAxes).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from maxmoe.kernels import tokamax_ops
from maxmoe.kernels.blocked_mlp import block_expert_mlp
from maxmoe.kernels.fp8 import (
    NO_AXES,
    AmaxAxes,
)
from maxmoe.kernels.fp8_ragged import dequantised_ragged_dot, fp8_ragged_dot
from maxmoe.sharding import mesh_platform


def dropless_local(x, expert_idx, weights, w_gate, w_up, w_down, first_expert, *,
                   grouped_matmul: str = "auto", block_size: int = 0, fp8: str = "none",
                   amax: AmaxAxes = NO_AXES):
    """Runs experts [first_expert, first_expert + El) on the tokens routed to them.

    x [..., D] (T rows once flattened); expert_idx, weights [T, K] (global expert ids);
    w_gate, w_up [El, D, F]; w_down [El, F, D]. Returns [T, D] float32: the weighted sum over
    this shard's experts.
    grouped_matmul: "tokamax" (tokamax_ops.ragged_dot, the Mosaic GPU grouped GEMM, over rows
    sorted by expert; ConfigError off NVIDIA GPUs or for float32), "ragged_dot"
    (lax.ragged_dot over the same rows), "blocked" (rows sorted by expert, each expert padded
    to whole blocks of block_size rows, then `block_expert_mlp`, a loop over the blocks in
    use: the fast form on XLA:CPU) or "auto" (resolve_kernel).
    fp8: precision.fp8; tensorwise / blockwise run the expert GEMMs on E4M3 operands
    (kernels/fp8.py; ragged_dot: `fp8_ragged_dot`, blocked: inside `block_expert_mlp`), or,
    with tokamax, on E4M3-rounded operands dequantised to x's dtype (`dequantised_ragged_dot`:
    tokamax has no FP8 ragged kernel for SM90).
    amax: the mesh axes a tensorwise amax spans (kernels/fp8.AmaxAxes; the caller's shard_map).
    """
    grouped_matmul = resolve_kernel(grouped_matmul, x.dtype)
    if grouped_matmul == "tokamax":
        tokamax_ops.require("moe.grouped_matmul=tokamax", x.dtype)
    tokamax_ops.log_kernel("moe grouped matmul", grouped_matmul)
    k, num_local = expert_idx.shape[1], w_gate.shape[0]
    scope = jax.named_scope  # the profile's MoE parts (blocked: no separate combine)
    if grouped_matmul == "blocked":
        with scope("dispatch"):
            token, row_weight, bounds = blocked_rows(expert_idx, weights, first_expert,
                                                     num_local, block_size)
        with scope("grouped_matmul"):  # gathers, weights and scatters block by block itself
            return block_expert_mlp(x, token, row_weight, w_gate, w_up, w_down, bounds, fp8,
                                    amax)
    with scope("dispatch"):  # ragged_dot
        _, order, sizes = _by_expert(expert_idx, first_expert, num_local)
        x = x.reshape(-1, x.shape[-1])
        token = order // k
        xs = x[token]  # rows past sum(sizes) belong to other shards: ragged_dot gives zeros
    with scope("grouped_matmul"):
        def mm(a, w):
            if grouped_matmul == "tokamax":
                if fp8 == "none":
                    return tokamax_ops.ragged_dot(a, w, sizes)
                return dequantised_ragged_dot(a, w, sizes, fp8, amax)
            if fp8 == "none":
                return jax.lax.ragged_dot(a, w, sizes)
            return fp8_ragged_dot(a, w, sizes, fp8, amax)
        h = jax.nn.silu(mm(xs, w_gate)) * mm(xs, w_up)
        out = mm(h, w_down).astype(jnp.float32)
    with scope("combine"):
        out = out * weights.reshape(-1)[order][:, None].astype(jnp.float32)
        # K contributions per token are summed in float32 before the cast back
        return jnp.zeros(x.shape, jnp.float32).at[token].add(out)


def resolve_kernel(grouped_matmul: str, dtype=jnp.bfloat16) -> str:
    """moe.grouped_matmul with auto resolved for operands of `dtype` on the
    current mesh's devices (sharding.mesh_device): blocked on CPU (XLA:CPU lowers ragged_dot
    densely); on NVIDIA GPUs tokamax where its Mosaic grouped GEMM takes the operands
    (bfloat16/float16; under FP8 on dequantised E4M3 values), else blocked (XLA:GPU expands
    ragged_dot densely too); ragged_dot on other devices."""
    if grouped_matmul != "auto":
        return grouped_matmul
    if mesh_platform() == "cpu":
        return "blocked"
    if tokamax_ops.nvidia_gpu():
        return "tokamax" if jnp.dtype(dtype) in tokamax_ops.DTYPES else "blocked"
    return "ragged_dot"


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
