"""The round machinery of the dropless all-to-all transport (`AllToAll`, parallel/dispatch.py):
each (token, destination) assignment goes once to its shard in
rounds of `cap` slots per (source, destination) pair, the shard runs its experts on what it
received, and the outputs come back to the sender, which weights and sums them in float32.

`Route` holds the static facts of one exchange; `exchange_rounds(route, x, w, w_gate, w_up,
w_down, order, starts, counts, recv_counts, local_id) -> [T, D] float32` runs rounds
0..route.rounds-1 under a custom VJP whose residuals are the inputs (memory does not grow with
the round count). The exchange is `lax.ragged_all_to_all` (route.ragged) or a dense
`lax.all_to_all` of the same [n, cap, D] buffers (XLA:CPU cannot compile the ragged one).

The round count is static: `worst_rounds`, the rounds that carry a source's assignments to
one destination under any routing (a token's K experts are distinct, so a pair holds at most
T min(K, El) of them). A loop bound read from the data (max over pairs of ceil(count / cap),
as this module had) is a while loop without a known trip count on XLA:GPU: every round copies
its predicate to the host and waits. DeepEP's low-latency kernels and Megatron's capacity
factor avoid that sync with static buffer bounds too; the price here is time, not memory and
not tokens: the buffers stay [n, cap, D] (c T K rows whatever ep) and nothing is dropped, but
every round runs whether rows fill it or not. Empty rounds move no rows (ragged_all_to_all's
send sizes are 0) and give the grouped GEMM empty groups, yet the slot gathers, the zeroing
and the combine's scatter run on whole buffers: ceil(ep min(K, El) / (c K)) rounds where
balanced routing fills 1, which at large ep likely costs more than the syncs it removes
(docs/performance/gpu.md, Static dispatch rounds, with the way to make empty rounds cheap; a
larger moe.transport_buffer_factor c trades buffer memory for fewer rounds). moe.transport_rounds N
> 0 runs N rounds instead, Megatron's capacity-factor trade: what does not fit is dropped.
`plan_rounds` measures the rounds the data needed (the dispatch_rounds metric) and counts the
assignments past the static rounds as dropped (dropped_fraction): under worst_rounds only
repeated expert ids within a token can make any.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxmoe.kernels.blocked_mlp import block_expert_mlp, block_expert_mlp_accumulate
from maxmoe.kernels.fp8 import NO_AXES, AmaxAxes, e4m3_wire
from maxmoe.kernels.grouped_matmul import _stable_argsort, blocked_rows, dropless_local
from maxmoe.parallel.grouped import batched_by_slices

# the name scope of the rounds loops (forward and backward): the planner counts their
# collectives once (plan/collectives.py), not once per static round
ROUNDS_SCOPE = "exchange_rounds"


@dataclasses.dataclass(frozen=True)
class Route:
    """Static facts of an AllToAll exchange: the group's mesh axes and size, K, the experts per
    shard, the slots per pair and round, the exchange primitive, the grouped-matmul kernel,
    the rounds run (static), and groups: None (the group is all of `axes`) or the
    axis_index_groups of an exchange inside subgroups of `group` members each (lists of
    indices along `axes`; TwoLevel's hops).
    """
    axes: tuple[str, ...]
    group: int
    k: int
    num_local: int
    cap: int
    ragged: bool
    grouped_matmul: str
    block_size: int
    groups: tuple[tuple[int, ...], ...] | None = None
    rounds: int = 1  # the loop's static trip count (worst_rounds)
    fp8: str = "none"  # precision.fp8 of the expert GEMMs (kernels/fp8.py); not none: the
    # dispatched rows travel in E4M3 (dispatch_slots)
    amax: AmaxAxes = NO_AXES  # the axes a tensorwise amax spans (each round scales apart)

    def member(self):
        """This device's index in its exchange group (int32)."""
        index = jax.lax.axis_index(self.axes).astype(jnp.int32)
        if self.groups is None:
            return index
        position = np.zeros(sum(len(g) for g in self.groups), np.int32)
        for g in self.groups:
            position[list(g)] = np.arange(len(g))
        return jnp.asarray(position)[index]


def exchange_counts(route: Route, counts):
    """counts [group] this device sends each member -> [group] each member sends here."""
    if not route.axes:
        return counts
    return _batchable(route.groups is not None, lambda c: jax.lax.all_to_all(
        c, route.axes, 0, 0, tiled=True, axis_index_groups=route.groups))(counts)


def worst_rounds(rows: int, k: int, num_local: int, cap: int) -> int:
    """Rounds of `cap` slots a pair needs under any routing of `rows` tokens with k distinct
    experts each, num_local of them on the destination: ceil(rows min(k, num_local) / cap)."""
    return max(1, -(-rows * min(k, num_local) // cap))


def plan_rounds(route: Route, key, local_id):
    """The routing arrays of exchange_rounds (after x, w and the weights) for assignments
    key [N] (their destination member, 0..group-1; group: not sent) of local expert local_id
    [N] (the expert within the destination's shard): ((order, starts, counts, recv_counts,
    local_id), needed, dropped): needed the rounds this device's data fills (max over its
    pairs of ceil(count / cap)), dropped its assignments past route.rounds (0 unless expert
    ids repeat within a token)."""
    n = route.group
    order = _stable_argsort(key, n + 1)
    counts = jnp.bincount(key, length=n + 1)[:n].astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    needed = -(-jnp.max(counts) // route.cap)
    dropped = jnp.sum(jnp.maximum(counts - route.rounds * route.cap, 0))
    return ((order, starts, counts, exchange_counts(route, counts),
             local_id.astype(jnp.int32)), needed, dropped)


def move_slots(route: Route, buf, send_sizes, recv_sizes, fill):
    """[n, cap, ...] slot buffers: row block j goes to group member j, which receives it as
    its row block i (this device's index). Rows past send_sizes[j] are not sent by the ragged
    form (the receiver keeps `fill` there); the dense CPU form sends whole blocks, so the
    caller fills unsent rows with `fill` itself and both forms give the same result."""
    if not route.axes:
        return buf
    if not route.ragged:
        return _batchable(route.groups is not None, lambda b: jax.lax.all_to_all(
            b, route.axes, 0, 0, tiled=False, axis_index_groups=route.groups))(buf)
    n, cap = buf.shape[:2]
    rows = buf.reshape(n * cap, *buf.shape[2:])
    offsets = jnp.arange(n, dtype=jnp.int32) * cap
    out = _batchable(True, lambda *a: jax.lax.ragged_all_to_all(
        *a, axis_name=route.axes, axis_index_groups=route.groups))(
        rows, jnp.full_like(rows, fill), offsets, send_sizes.astype(jnp.int32),
        jnp.full((n,), route.member() * cap, jnp.int32), recv_sizes.astype(jnp.int32))
    return out.reshape(buf.shape)


def _batchable(wrap: bool, collective):
    """collective, wrapped (wrap) so that it batches under the pipeline's vmap: jax refuses to
    batch one over axis_index_groups, and its ragged_all_to_all rule fails on offsets that are
    not batched (parallel/grouped.py)."""
    return batched_by_slices(collective) if wrap else collective


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def exchange_slots(route: Route, buf, send_sizes, recv_sizes):
    """move_slots of float rows (fill 0) whose transpose is the inverse exchange (sizes swapped):
    no reliance on a transpose rule of ragged_all_to_all."""
    return move_slots(route, buf, send_sizes, recv_sizes, 0)


def _exchange_slots_fwd(route, buf, send_sizes, recv_sizes):
    return move_slots(route, buf, send_sizes, recv_sizes, 0), (send_sizes, recv_sizes)


def _exchange_slots_bwd(route, res, g):
    send_sizes, recv_sizes = res
    return move_slots(route, g, recv_sizes, send_sizes, 0), None, None


exchange_slots.defvjp(_exchange_slots_fwd, _exchange_slots_bwd)


def dispatch_slots(route: Route, buf, send_sizes, recv_sizes):
    """exchange_slots of dispatched token rows buf [n, cap, D]: under route.fp8 (either mode)
    as E4M3 1x128 tiles with float32 scales (kernels/fp8.e4m3_wire: DeepSeek-V3's FP8
    dispatch; the gradient comes back unquantised, in buf's dtype), rounded in place where
    nothing travels (no axes). The combine stays in the compute dtype (exchange_slots)."""
    if route.fp8 == "none":
        return exchange_slots(route, buf, send_sizes, recv_sizes)
    move = functools.partial(_slots_there, route) if route.axes else None
    back = functools.partial(_slots_back, route) if route.axes else None
    return e4m3_wire(move, back, buf, send_sizes, recv_sizes)


def _slots_there(route, buf, send_sizes, recv_sizes):
    return move_slots(route, buf, send_sizes, recv_sizes, 0)


def _slots_back(route, g, send_sizes, recv_sizes):
    return move_slots(route, g, recv_sizes, send_sizes, 0)


def _send(route: Route, r, x, order, starts, counts, recv_counts, local_id):
    """Round r's dispatch: the assignments of rank [r cap, (r+1) cap) within their (this
    device, destination) pair go to their destination. x [T, D]; order [T K] the assignments
    sorted by destination (others last); starts / counts [n] per destination; recv_counts [n]
    per source; local_id [T K] each assignment's expert within its shard.
    Returns (valid [n, cap], a [n, cap] the assignment in each slot, send_sizes, recv_sizes
    [n], rows [n cap, D] received, ids [n cap, 1] their local expert, num_local if empty)."""
    n, cap, num_local = route.group, route.cap, route.num_local
    rank = r * cap + jnp.arange(cap)  # [cap]
    valid = rank[None, :] < counts[:, None]  # [n, cap]
    a = order[jnp.clip(starts[:, None] + rank[None, :], 0, order.shape[0] - 1)]
    send = jnp.where(valid[..., None], x[a // route.k], jnp.zeros((), x.dtype))  # [n, cap, D]
    ids = jnp.where(valid, local_id[a], num_local)  # num_local: an empty slot
    send_sizes = jnp.clip(counts - r * cap, 0, cap)
    recv_sizes = jnp.clip(recv_counts - r * cap, 0, cap)
    rows = dispatch_slots(route, send, send_sizes, recv_sizes).reshape(n * cap, -1)
    ids = move_slots(route, ids[..., None], send_sizes, recv_sizes, num_local).reshape(n * cap, 1)
    return valid, a, send_sizes, recv_sizes, rows, ids


def _one_round(route: Route, r, x, w, w_gate, w_up, w_down, *routing):
    """Round r (see _send for the routing arrays): dispatch, this shard's experts on the
    received rows, the outputs back, combined with the router weights w [T K] in float32.
    Returns [T, D] float32."""
    n, cap = route.group, route.cap
    with jax.named_scope("dispatch"):
        valid, a, send_sizes, recv_sizes, rows, ids = _send(route, r, x, *routing)
    ones = jnp.ones((n * cap, 1), jnp.float32)  # router weights are applied by the sender
    out = dropless_local(rows, ids, ones, w_gate, w_up, w_down, 0,
                         grouped_matmul=route.grouped_matmul, block_size=route.block_size,
                         fp8=route.fp8, amax=route.amax)
    with jax.named_scope("combine"):
        # outputs travel back in the compute dtype; weighted and summed in float32
        back = exchange_slots(route, out.astype(x.dtype).reshape(n, cap, -1), recv_sizes,
                              send_sizes)
        weight = jnp.where(valid, w[a].astype(jnp.float32), 0.0)
        contrib = back.astype(jnp.float32) * weight[..., None]
        return jnp.zeros((x.shape[0], back.shape[-1]), jnp.float32).at[a // route.k].add(contrib)


def _blocked_round_grads(route: Route, r, acc, gy, x, w, w_gate, w_up, w_down, *routing):
    """Round r's backward for the blocked kernel, written out (the transposes of _one_round)
    so that the expert-weight gradients of all rounds add into one set of float32
    accumulators inside the kernel (block_expert_mlp_accumulate). acc = (dx [T, D], dw [T K],
    d w_gate, d w_up, d w_down), float32; returns it updated. Recomputes the round's forward."""
    n, cap, k = route.group, route.cap, route.k
    dx, dw, *dweights = acc
    valid, a, send_sizes, recv_sizes, rows, ids = _send(route, r, x, *routing)
    ones = jnp.ones((n * cap, 1), jnp.float32)
    plan = blocked_rows(ids, ones, 0, route.num_local, route.block_size)
    out = block_expert_mlp(rows, plan[0], plan[1], w_gate, w_up, w_down, plan[2], route.fp8,
                           route.amax)
    back = move_slots(route, out.astype(x.dtype).reshape(n, cap, -1), recv_sizes, send_sizes, 0)
    g = gy[a // k]  # [n, cap, D] float32
    dw = dw.at[a].add(jnp.where(valid, jnp.sum(g * back.astype(jnp.float32), -1), 0.0))
    weight = jnp.where(valid, w[a].astype(jnp.float32), 0.0)
    g_out = move_slots(route, (g * weight[..., None]).astype(x.dtype), send_sizes, recv_sizes, 0)
    zeros = (jnp.zeros(rows.shape, jnp.float32), jnp.zeros(plan[1].shape, jnp.float32))
    g_rows, _, *dweights = block_expert_mlp_accumulate(
        (*zeros, *dweights), g_out.reshape(n * cap, -1), rows, *plan[:2], w_gate, w_up,
        w_down, plan[2], route.fp8, route.amax)
    g_send = move_slots(route, g_rows.astype(x.dtype).reshape(n, cap, -1), recv_sizes,
                        send_sizes, 0)
    dx = dx.at[a // k].add(jnp.where(valid[..., None], g_send.astype(jnp.float32), 0.0))
    return (dx, dw, *dweights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def exchange_rounds(route: Route, x, w, w_gate, w_up, w_down, order, starts, counts,
                    recv_counts, local_id):
    """Sum over rounds 0..route.rounds-1 of _one_round: [T, D] float32. A custom_vjp whose
    backward loops over the rounds again, recomputing each (under jax.vjp; for the blocked
    kernel its transposes written out, _blocked_round_grads), so the residuals are the inputs (no
    per-round stacks: memory does not grow with the round count)."""
    return _rounds_fwd(route, x, w, w_gate, w_up, w_down, order, starts, counts, recv_counts,
                       local_id)[0]


def _rounds_fwd(route, x, w, w_gate, w_up, w_down, *routing):
    with jax.named_scope(ROUNDS_SCOPE):
        y = jax.lax.fori_loop(
            0, route.rounds,
            lambda r, y: y + _one_round(route, r, x, w, w_gate, w_up, w_down, *routing),
            jnp.zeros((x.shape[0], w_down.shape[-1]), jnp.float32))
    return y, (x, w, w_gate, w_up, w_down, *routing)


def _rounds_bwd(route, res, gy):
    """Gradients summed over rounds in float32, cast to each input's dtype once at the end:
    summed in bf16, every round's add rounded to the running sum and the weight-gradient error
    grew with the round count (docs/performance/parallelism.md, Multi-round gradients). The float32
    accumulators of the local expert weights are what the blocked kernel holds too (it sums
    its weight gradients inside, `_blocked_round_grads`)."""
    x, w, w_gate, w_up, w_down, *routing = res
    diff = (x, w, w_gate, w_up, w_down)

    def step(r, acc):
        if route.grouped_matmul == "blocked":
            return _blocked_round_grads(route, r, acc, gy, *diff, *routing)
        _, vjp = jax.vjp(lambda *a: _one_round(route, r, *a, *routing), *diff)
        return tuple(s + g.astype(jnp.float32) for s, g in zip(acc, vjp(gy), strict=True))
    with jax.named_scope(ROUNDS_SCOPE):
        grads = jax.lax.fori_loop(0, route.rounds, step,
                                  tuple(jnp.zeros(a.shape, jnp.float32) for a in diff))
    return (*(g.astype(a.dtype) for g, a in zip(grads, diff, strict=True)),
            *(None for _ in routing))


exchange_rounds.defvjp(_rounds_fwd, _rounds_bwd)
