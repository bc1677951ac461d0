"""Routed-expert computation, expert-parallel over the mesh: dropless or capacity-bounded.

Inside `shard_map` every device holds its batch shard of tokens and E/ep of the experts
(ep = size of the mesh axes the logical `experts` axis maps to).

- dropless: tokens are all-gathered over the expert axis, each device sorts the (token, k)
  assignments that hit its own experts, runs them as a grouped matmul (kernels/grouped_matmul.py:
  `lax.ragged_dot` on GPU; on CPU `block_expert_mlp`, a loop over per-expert row blocks that
  gathers, computes and scatters in one; nothing dropped whatever the imbalance) and
  reduce-scatters the partial outputs back to the token owners. This all-gather/reduce-scatter
  form needs no ragged all-to-all (absent on XLA:CPU), moves each token once rather than once
  per k, and wins for small expert axes.
- capacity: every device packs its own assignments into fixed slots per expert
  (GShard/Switch), exchanges them with one all-to-all over the expert axis, runs dense batched
  matmuls and sends results back with a second all-to-all. Slots are counted per sequence
  (capacity_for), so which assignments are dropped does not depend on the layout. Overflowing
  assignments are dropped, by arrival order ("position") or lowest router weight first
  ("probability").

Both return (y [B, S, D], dropped fraction of (token, k) assignments on this batch).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxmoe.config import MoEConfig
from maxmoe.kernels.grouped_matmul import dropless_local
from maxmoe.sharding import current_mesh, mesh_axes


def capacity_slots(expert_idx, weights, num_experts: int, capacity: int, drop_policy: str):
    """Slot of every (token, k) assignment in its expert's buffer; -1 when dropped.

    expert_idx, weights [T, K]. Returns slot [T, K] int32. Priority: all first choices before
    any second choice (GShard), then token order ("position") or router weight ("probability").
    """
    t, k = expert_idx.shape
    flat_e = expert_idx.T.reshape(-1)  # k-major: first choices first
    if drop_policy == "probability":
        order = jnp.argsort(-weights.T.reshape(-1), stable=True)
    else:
        order = jnp.arange(t * k)
    onehot = jax.nn.one_hot(flat_e[order], num_experts, dtype=jnp.int32)  # [T*K, E]
    position = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    slot_sorted = jnp.where(position < capacity, position, -1)
    slot = jnp.zeros((t * k,), jnp.int32).at[order].set(slot_sorted)
    return slot.reshape(k, t).T


def capacity_for(seq_len: int, cfg: MoEConfig) -> int:
    """Slots per expert per sequence of `seq_len` tokens: ceil(factor * seq_len * K / E).

    Per sequence, not per device: every layout gives each device whole sequences inside the
    dispatch (its shard_map splits only the batch dim), so a sequence's assignments compete for
    the same slots on any mesh, in any pipeline microbatch, and one device drops exactly what a
    sharded run drops.
    """
    return max(1, math.ceil(cfg.capacity_factor * seq_len * cfg.experts_per_token
                            / cfg.num_experts))


def capacity_dispatch(x, expert_idx, weights, w_gate, w_up, w_down, cfg: MoEConfig,
                      seq_len: int, exchange=None):
    """Capacity-bounded experts for local tokens x [T, D], T = whole sequences of seq_len
    tokens (row-major). exchange(buf, inverse) moves [E, C, D] buffers between expert shards
    (all-to-all); None = all experts are local.

    Each sequence ranks its own assignments (capacity_slots) into capacity_for(seq_len) slots
    per expert; C = sequences x that. Returns ([T, D] float32, number of dropped assignments).
    """
    t, d = x.shape
    num_experts, k = cfg.num_experts, expert_idx.shape[-1]
    rows, per_seq = t // seq_len, capacity_for(seq_len, cfg)
    capacity = rows * per_seq
    with jax.named_scope("dispatch"):
        slot = jax.vmap(lambda i, w: capacity_slots(i, w, num_experts, per_seq, cfg.drop_policy))(
            expert_idx.reshape(rows, seq_len, k), weights.reshape(rows, seq_len, k))
        first = (jnp.arange(rows, dtype=jnp.int32) * per_seq)[:, None, None]
        slot = jnp.where(slot >= 0, slot + first, -1).reshape(t, k)  # sequence r: [r C_s, ...)
        kept = slot >= 0
        tok = jnp.broadcast_to(jnp.arange(t)[:, None], slot.shape)
        buf = jnp.zeros((num_experts, capacity, d), x.dtype)
        buf = buf.at[expert_idx, jnp.where(kept, slot, capacity)].set(x[tok], mode="drop")
        if exchange is not None:
            buf = exchange(buf, inverse=False)  # [E, C, D] -> [ep, El, C, D] received
    with jax.named_scope("grouped_matmul"):
        h = jax.nn.silu(jnp.einsum("...cd,...df->...cf", buf, w_gate)) * jnp.einsum(
            "...cd,...df->...cf", buf, w_up)
        out = jnp.einsum("...cf,...fd->...cd", h, w_down)
    with jax.named_scope("combine"):
        if exchange is not None:
            out = exchange(out, inverse=True)
        gathered = out[expert_idx, jnp.where(kept, slot, 0)].astype(jnp.float32)  # [T, K, D]
        w = jnp.where(kept, weights, 0.0).astype(jnp.float32)
        return jnp.einsum("tkd,tk->td", gathered, w), jnp.sum(~kept)


def routed_experts(x, expert_idx, weights, w_gate, w_up, w_down, cfg: MoEConfig):
    """x [B, S, D]; expert_idx, weights [B, S, K]; expert weights [E, D, F] / [E, F, D].

    Returns (y [B, S, D] in x.dtype, dropped fraction). Without a mesh or on a one-device
    mesh no shard_map is built: its transpose would all-reduce the expert weight gradients
    over the size-1 axes, which XLA:CPU runs as copies.
    """
    b, s, d = x.shape
    total = b * s * expert_idx.shape[-1]
    if current_mesh() is None or current_mesh().size == 1:
        xf, idx, w = x.reshape(-1, d), expert_idx.reshape(b * s, -1), weights.reshape(b * s, -1)
        if cfg.dispatch == "capacity":
            y, dropped = capacity_dispatch(xf, idx, w, w_gate, w_up, w_down, cfg, s)
        else:
            # x itself, not xf: the same array as the router's input, one residual for both
            y = dropless_local(x, idx, w, w_gate, w_up, w_down, 0,
                               grouped_matmul=cfg.grouped_matmul, block_size=cfg.block_size)
            dropped = 0
        return y.astype(x.dtype).reshape(b, s, d), jnp.asarray(dropped, jnp.float32) / total

    batch, ep, tp = mesh_axes("batch"), mesh_axes("experts"), mesh_axes("expert_mlp")
    gathered = tuple(a for a in ep if a in batch)  # tokens of these shards meet the experts
    replicated = tuple(a for a in ep if a not in batch)  # tokens already present everywhere
    tok = P(batch or None, None, None)
    wspec_in = P(ep or None, None, tp or None)
    wspec_out = P(ep or None, tp or None, None)
    capacity_mode = cfg.dispatch == "capacity"

    # check_vma off: under the pipeline's vmap (spmd_axis_name) the varying-axes inference
    # wrongly flags outputs as varying over the stage axis; the equivalence tests pin the specs
    @functools.partial(jax.shard_map, in_specs=(tok, tok, tok, wspec_in, wspec_in, wspec_out),
                       out_specs=(tok, P()), check_vma=False)
    def body(x, idx, w, wg, wu, wd):
        b, s, d = x.shape
        xf, idx, w = x.reshape(-1, d), idx.reshape(b * s, -1), w.reshape(b * s, -1)
        first = jax.lax.axis_index(ep) * wg.shape[0] if ep else 0
        dropped = jnp.zeros((), jnp.int32)
        if capacity_mode:
            if replicated:  # every shard sees every token: keep the slots of its own experts
                y, dropped = capacity_dispatch(xf, idx, w, *_padded_local(wg, wu, wd, first, cfg),
                                               cfg, s)
            else:
                y, dropped = capacity_dispatch(xf, idx, w, wg, wu, wd, cfg, s,
                                               exchange=_exchange(gathered))
        else:
            if gathered:
                xf, idx, w = (jax.lax.all_gather(a, gathered, axis=0, tiled=True)
                              for a in (xf, idx, w))
            y = dropless_local(xf, idx, w, wg, wu, wd, first,
                               grouped_matmul=cfg.grouped_matmul, block_size=cfg.block_size)
            if gathered:
                y = jax.lax.psum_scatter(y, gathered, scatter_dimension=0, tiled=True)
        if replicated + tp:
            y = jax.lax.psum(y, replicated + tp)
        # each batch shard counts its own tokens once; other axes hold identical counts
        dropped = jax.lax.psum(dropped, batch) if batch else dropped
        # (stage axes excluded: under the pipeline's vmap each stage has its own tokens)
        others = tuple(a for a in current_mesh().axis_names
                       if a not in batch and a not in mesh_axes("stage"))
        dropped = jax.lax.pmax(dropped, others) if others else dropped
        return y.astype(x.dtype).reshape(b, s, d), dropped

    y, dropped = body(x, expert_idx, weights, w_gate, w_up, w_down)
    return y, dropped.astype(jnp.float32) / total


def _exchange(axes):
    """All-to-all of [E, C, D] slot buffers over the expert shards `axes` (and back)."""
    def exchange(buf, inverse):
        if not inverse:  # [E, C, D] -> [ep, El, C, D]: slots for shard j go to shard j
            ep = math.prod(current_mesh().shape[a] for a in axes)
            buf = buf.reshape(ep, buf.shape[0] // ep, *buf.shape[1:])
            return jax.lax.all_to_all(buf, axes, split_axis=0, concat_axis=0, tiled=False)
        out = jax.lax.all_to_all(buf, axes, split_axis=0, concat_axis=0, tiled=False)
        return out.reshape(-1, *out.shape[2:])  # back to [E, C, D] on the token owner
    return exchange


def _padded_local(wg, wu, wd, first, cfg: MoEConfig):
    """Local expert weights placed into zero-padded full-E stacks (tokens replicated case)."""
    def pad(w):
        full = jnp.zeros((cfg.num_experts, *w.shape[1:]), w.dtype)
        return jax.lax.dynamic_update_slice_in_dim(full, w, first, axis=0)
    return pad(wg), pad(wu), pad(wd)
