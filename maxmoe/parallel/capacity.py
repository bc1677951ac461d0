"""The capacity dispatcher (moe.dispatch=capacity, may drop): GShard/Switch slot buffers.

Every device packs its own (token, k) assignments into `capacity` slots per expert, exchanges
them with one all-to-all over the expert axis, runs dense batched matmuls and sends the results
back with a second all-to-all. Slots are counted per sequence (`capacity_for`), so which
assignments are dropped does not depend on the layout. Overflowing assignments are dropped, by
arrival order ("position") or lowest router weight first ("probability").

`Capacity` is the `Dispatcher` (parallel/dispatch.py's interface); `capacity_dispatch` the
computation, `capacity_slots` the slot ranking.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from maxmoe.config import MoEConfig
from maxmoe.kernels.fp8 import NO_AXES, AmaxAxes, e4m3_wire, fp8_dot
from maxmoe.parallel.dispatch import Dispatched, Dispatcher, ExpertShards
from maxmoe.sharding import current_mesh


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
                      seq_len: int, exchange=None, fp8: str = "none",
                      amax: AmaxAxes = NO_AXES):
    """Capacity-bounded experts for local tokens x [T, D], T = whole sequences of seq_len
    tokens (row-major). exchange(buf, inverse) moves [E, C, D] buffers between expert shards
    (all-to-all); None = all experts are local.

    Each sequence ranks its own assignments (capacity_slots) into capacity_for(seq_len) slots
    per expert; C = sequences x that. Returns ([T, D] float32, number of dropped assignments).
    fp8: precision.fp8 of the expert GEMMs (each expert's slots through kernels/fp8.fp8_dot;
    tensorwise: one scale per expert's slot buffer, its amax reduced over amax's axes); not
    none: the slots travel in E4M3 (_dispatch), the results come back in x's dtype.
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
        buf = _dispatch(buf, exchange, fp8)  # [E, C, D] -> [ep, El, C, D] received
    with jax.named_scope("grouped_matmul"):
        h = jax.nn.silu(_per_expert(buf, w_gate, fp8, amax)) * _per_expert(buf, w_up, fp8, amax)
        out = _per_expert(h, w_down, fp8, amax)
    with jax.named_scope("combine"):
        if exchange is not None:
            out = exchange(out, inverse=True)
        gathered = out[expert_idx, jnp.where(kept, slot, 0)].astype(jnp.float32)  # [T, K, D]
        w = jnp.where(kept, weights, 0.0).astype(jnp.float32)
        return jnp.einsum("tkd,tk->td", gathered, w), jnp.sum(~kept)


class Capacity(Dispatcher):
    """Capacity-bounded slots per expert (GShard/Switch), the overflow dropped
    (`capacity_dispatch`, slots per sequence of seq_len tokens); one all-to-all of [E, C, D]
    slot buffers each way."""

    def __init__(self, cfg: MoEConfig, shards: ExpertShards | None = None, seq_len: int = 0):
        super().__init__(cfg, shards)
        self.seq_len = seq_len

    def __call__(self, x, expert_idx, weights, w_gate, w_up, w_down) -> Dispatched:
        cfg, shards = self.cfg, self.shards
        x = x.reshape(-1, x.shape[-1])
        # per-expert scales: not reduced over the expert axes, whose shards hold other experts
        amax = AmaxAxes(tuple(a for a in self.amax.rows if a not in shards.axes),
                        self.amax.weights)
        if any(a not in shards.gathered for a in shards.axes):
            # tokens replicated over some expert axes: every shard keeps its own experts' slots
            first = shards.first_expert(w_gate.shape[0])
            y, dropped = capacity_dispatch(x, expert_idx, weights,
                                           *_padded_local(w_gate, w_up, w_down, first, cfg), cfg,
                                           self.seq_len, fp8=self.fp8, amax=amax)
        else:
            exchange = _slot_exchange(shards.gathered) if shards.gathered else None
            y, dropped = capacity_dispatch(x, expert_idx, weights, w_gate, w_up, w_down, cfg,
                                           self.seq_len, exchange=exchange, fp8=self.fp8,
                                           amax=amax)
        return Dispatched(y, jnp.asarray(dropped, jnp.int32), jnp.ones((), jnp.int32))


def _dispatch(buf, exchange, fp8: str):
    """The slot buffers [E, C, D] on their way to the experts: exchange(buf, inverse=False),
    or buf where exchange is None; under precision.fp8 (either mode) in E4M3 1x128 tiles with
    float32 scales (kernels/fp8.e4m3_wire; the gradient comes back by the inverse exchange in
    buf's dtype), rounded in place where nothing travels."""
    if fp8 == "none":
        return buf if exchange is None else exchange(buf, inverse=False)
    if exchange is None:
        return e4m3_wire(None, None, buf)
    return e4m3_wire(functools.partial(exchange, inverse=False),
                     functools.partial(exchange, inverse=True), buf)


def _per_expert(buf, w, fp8: str, amax: AmaxAxes):
    """Slot buffers [..., E, C, In] @ expert weights [E, In, Out] -> [..., E, C, Out]."""
    if fp8 == "none":
        return jnp.einsum("...cd,...df->...cf", buf, w)
    return jax.vmap(lambda b, we: fp8_dot(b, we, fp8, amax), in_axes=(-3, 0), out_axes=-3)(
        buf, w)


def _slot_exchange(axes):
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
