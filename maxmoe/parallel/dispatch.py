"""Token dispatchers: how the (token, k) assignments of a device reach the expert shards that
hold their experts, and how the expert outputs come back. One class per strategy, one call
signature (Megatron-Core's token dispatchers are the model):

    dispatcher(x [T, D], expert_idx [T, K], weights [T, K], w_gate, w_up [El, D, F],
               w_down [El, F, D]) -> Dispatched(y [T, D] float32, dropped, rounds)

called inside parallel/experts.py's `shard_map` body (or without a mesh, with no shards).
`ExpertShards` says where the device sits on the expert axes.

- `AllGather` (dropless): every token of the expert axis goes to every expert shard, each runs
  the assignments of its own experts (kernels/grouped_matmul.py) and a reduce-scatter returns
  the partial outputs. Buffers grow with ep (T x ep rows per device); it wins for small expert
  axes inside a host, where the all-gather is cheap and moves each token once, not K times.
- `AllToAll` (dropless): each (token, destination shard) assignment is sent once, in rounds of
  a fixed number of slots per (source, destination) pair, cap = ceil(c T K / ep), so the
  receive buffer is ep x cap = c T K rows whatever ep (c = moe.transport_buffer_factor).
  Assignments beyond cap go in extra rounds (their number is the max over pairs of
  ceil(count / cap)), so nothing is dropped under any routing. The exchange is
  `lax.ragged_all_to_all` on GPU/TPU and a dense `lax.all_to_all` of the same [ep, cap, D]
  buffers on CPU (XLA:CPU cannot compile the ragged one); the slots, rounds and combine are
  one code path for both.
- `Capacity` (may drop): GShard/Switch slot buffers per expert, one all-to-all each way
  (defined in parallel/experts.py next to `capacity_dispatch`).

`choose_transport` is the rule `moe.transport=auto` follows (make_trainer applies it to the
layout with `resolve_transport`); `describe_transport` is its start-up line.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxmoe.config import Config, MoEConfig
from maxmoe.kernels.grouped_matmul import (
    _stable_argsort,
    block_expert_mlp,
    block_expert_mlp_accumulate,
    blocked_rows,
    dropless_local,
    resolve_kernel,
)
from maxmoe.sharding import mesh_platform

# auto: all_gather while the expert axis has at most this many shards (a host's GPUs) and
# lies inside one host (NVLink); all_to_all otherwise. all_gather's buffers hold T ep rows,
# all_to_all's c T K: below ep = c K (12 for DeepSeek-V3's K 8 at c 1.5) all_gather's are the
# smaller ones (docs/performance.md, Expert-parallel transports)
AUTO_ALL_GATHER_MAX_EP = 8


def choose_transport(moe: MoEConfig, ep: int, ep_hosts: int) -> str:
    """The dropless transport for an expert axis of `ep` shards spread over `ep_hosts` hosts:
    moe.transport unless it is auto; auto = all_gather if ep <= AUTO_ALL_GATHER_MAX_EP and
    ep_hosts == 1, else all_to_all."""
    if moe.transport != "auto":
        return moe.transport
    return "all_gather" if ep <= AUTO_ALL_GATHER_MAX_EP and ep_hosts == 1 else "all_to_all"


def expert_axis_sizes(cfg: Config, mesh_sizes: dict[str, int]) -> tuple[int, int]:
    """(ep, hosts the expert axis spans) of a layout: the mesh axes the rules table maps
    `experts` to, and their DCN (across-host) factors mesh.dcn_*."""
    axes = cfg.mesh.rules.get("experts", [])
    ep = math.prod(mesh_sizes[a] for a in axes)
    hosts = math.prod(getattr(cfg.mesh, f"dcn_{a}") for a in axes)
    return ep, hosts


def resolve_transport(cfg: Config, mesh_sizes: dict[str, int]) -> Config:
    """cfg with moe.transport=auto replaced by the transport it picks on this layout (the DCN
    factors of the config count the hosts, so a one-process planner compile of a multi-host
    layout builds what the cluster will run)."""
    if cfg.moe.transport != "auto":
        return cfg
    transport = choose_transport(cfg.moe, *expert_axis_sizes(cfg, mesh_sizes))
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, transport=transport))


def describe_transport(cfg: Config, mesh_sizes: dict[str, int]) -> str | None:
    """One start-up line: the MoE dispatch and the transport `auto` chose; None without an
    expert axis (all experts local, nothing travels)."""
    ep, hosts = expert_axis_sizes(cfg, mesh_sizes)
    if ep == 1 or cfg.model.num_layers == cfg.model.num_dense_layers:
        return None
    moe = cfg.moe
    if moe.dispatch == "capacity":
        return (f"moe dispatch: capacity (factor {moe.capacity_factor}, may drop), all-to-all "
                f"of slot buffers over {ep} expert shards")
    how = choose_transport(moe, ep, hosts)
    why = "set" if moe.transport != "auto" else (
        f"auto: ep {ep} on {hosts} host(s); all_gather up to ep {AUTO_ALL_GATHER_MAX_EP} "
        "inside a host")
    extra = (f", buffer factor {moe.transport_buffer_factor}" if how == "all_to_all" else "")
    return f"moe dispatch: dropless, transport {how} over {ep} expert shards ({why}){extra}"


@dataclasses.dataclass(frozen=True)
class ExpertShards:
    """Where this device sits on the expert axes (inside shard_map).

    axes: the mesh axes of the logical `experts` axis, in order; sizes: their sizes.
    gathered: those that also shard the batch (tokens must travel over them); the others hold
    the same tokens on every shard (each keeps its own experts' assignments, and the caller
    sums over them). sync: the axes over which AllToAll agrees on one round count (at least
    the gathered ones; routed_experts passes every axis but the pipeline's, so all devices
    run the same trip count).
    """
    axes: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    gathered: tuple[str, ...] = ()
    sync: tuple[str, ...] = ()

    @property
    def group(self) -> int:
        """Shards of the exchange group (the gathered axes)."""
        return math.prod(n for a, n in zip(self.axes, self.sizes, strict=True)
                         if a in self.gathered)

    def first_expert(self, num_local: int):
        """Global id of this shard's first expert."""
        return jax.lax.axis_index(self.axes) * num_local if self.axes else 0

    def destination(self, shard):
        """Global expert shard ids [...] -> (index in the exchange group, whether the shard
        shares this device's coordinates on the non-gathered axes)."""
        dst, mine = jnp.zeros_like(shard), jnp.ones(shard.shape, bool)
        rest = shard
        for a, n in reversed(tuple(zip(self.axes, self.sizes, strict=True))):
            coord, rest = rest % n, rest // n  # row-major over axes, as axis_index(axes)
            if a in self.gathered:
                dst = dst + coord * math.prod(
                    m for b, m in zip(self.axes, self.sizes, strict=True)
                    if b in self.gathered and self.axes.index(b) > self.axes.index(a))
            else:
                mine = mine & (coord == jax.lax.axis_index(a))
        return dst, mine


class Dispatched(NamedTuple):
    y: jax.Array  # [T, D] float32, the weighted sum of each token's expert outputs
    dropped: jax.Array  # int: (token, k) assignments dropped on this device
    rounds: jax.Array  # int: exchange rounds run (1 for single-exchange transports)


class Dispatcher:
    """Base: cfg (the MoE config) and shards (this device's place on the expert axes)."""

    def __init__(self, cfg: MoEConfig, shards: ExpertShards | None = None):
        self.cfg, self.shards = cfg, shards or ExpertShards()

    def __call__(self, x, expert_idx, weights, w_gate, w_up, w_down) -> Dispatched:
        raise NotImplementedError


def _one():
    return jnp.ones((), jnp.int32)


class AllGather(Dispatcher):
    """Dropless: all-gather the tokens over the gathered expert axes, run this shard's experts,
    reduce-scatter the partial outputs. x may be [..., D] (read as its T flattened rows)."""

    def __call__(self, x, expert_idx, weights, w_gate, w_up, w_down) -> Dispatched:
        cfg, gathered = self.cfg, self.shards.gathered
        first = self.shards.first_expert(w_gate.shape[0])
        if gathered:
            x, expert_idx, weights = (jax.lax.all_gather(a, gathered, axis=0, tiled=True)
                                      for a in (x, expert_idx, weights))
        y = dropless_local(x, expert_idx, weights, w_gate, w_up, w_down, first,
                           grouped_matmul=cfg.grouped_matmul, block_size=cfg.block_size)
        if gathered:
            y = jax.lax.psum_scatter(y, gathered, scatter_dimension=0, tiled=True)
        return Dispatched(y, jnp.zeros((), jnp.int32), _one())


class AllToAll(Dispatcher):
    """Dropless: each assignment goes once to its expert's shard, in rounds of cap slots per
    (source, destination) pair; see the module docstring. ragged: use lax.ragged_all_to_all
    (None: on any platform but CPU, as sharding.mesh_platform says).

    Paper refs: GShard (Lepikhin et al. 2020) for the all-to-all expert exchange; the dropless
    grouped matmul is MegaBlocks' (Gale et al. 2022)."""

    def __init__(self, cfg: MoEConfig, shards: ExpertShards | None = None,
                 ragged: bool | None = None):
        super().__init__(cfg, shards)
        self.ragged = mesh_platform() != "cpu" if ragged is None else ragged

    def __call__(self, x, expert_idx, weights, w_gate, w_up, w_down) -> Dispatched:
        shards, cfg = self.shards, self.cfg
        x = x.reshape(-1, x.shape[-1])
        t, k = expert_idx.shape
        n, num_local = shards.group, w_gate.shape[0]
        route = _Route(axes=shards.gathered, group=n, k=k, num_local=num_local,
                       cap=max(1, math.ceil(cfg.transport_buffer_factor * t * k / n)),
                       ragged=self.ragged, grouped_matmul=resolve_kernel(cfg.grouped_matmul),
                       block_size=cfg.block_size)
        with jax.named_scope("dispatch"):
            shard = expert_idx.reshape(-1) // num_local
            dst, mine = shards.destination(shard)
            key = jnp.where(mine, dst, n)  # n: another shard group's expert, never sent
            order = _stable_argsort(key, n + 1)
            counts = jnp.bincount(key, length=n + 1)[:n].astype(jnp.int32)
            starts = jnp.cumsum(counts) - counts
            # what each source will send here: the exchange of the per-pair counts
            recv_counts = (jax.lax.all_to_all(counts, route.axes, 0, 0, tiled=True)
                           if route.axes else counts)
            local_id = expert_idx.reshape(-1) - shard * num_local  # expert within its shard
            # one trip count everywhere: the collectives of a round pair up across devices
            rounds = -(-jnp.max(counts) // route.cap)
            rounds = jax.lax.pmax(rounds, shards.sync) if shards.sync else rounds
        plan = (order, starts, counts, recv_counts, local_id.astype(jnp.int32), rounds)
        y = _rounds(route, x, weights.reshape(-1), w_gate, w_up, w_down, *plan)
        return Dispatched(y, jnp.zeros((), jnp.int32), rounds.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class _Route:
    """Static facts of an AllToAll exchange: the group's mesh axes and size, K, the experts per
    shard, the slots per pair and round, the exchange primitive, the grouped-matmul kernel."""
    axes: tuple[str, ...]
    group: int
    k: int
    num_local: int
    cap: int
    ragged: bool
    grouped_matmul: str
    block_size: int


def _move(route: _Route, buf, send_sizes, recv_sizes, fill):
    """[n, cap, ...] slot buffers: row block j goes to group member j, which receives it as
    its row block i (this device's index). Rows past send_sizes[j] are not sent by the ragged
    form (the receiver keeps `fill` there); the dense CPU form sends whole blocks, so the
    caller fills unsent rows with `fill` itself and both forms give the same result."""
    if not route.axes:
        return buf
    if not route.ragged:
        return jax.lax.all_to_all(buf, route.axes, 0, 0, tiled=False)
    n, cap = buf.shape[:2]
    rows = buf.reshape(n * cap, *buf.shape[2:])
    offsets = jnp.arange(n, dtype=jnp.int32) * cap
    me = jax.lax.axis_index(route.axes).astype(jnp.int32)
    out = jax.lax.ragged_all_to_all(
        rows, jnp.full_like(rows, fill), offsets, send_sizes.astype(jnp.int32),
        jnp.full((n,), me * cap, jnp.int32), recv_sizes.astype(jnp.int32),
        axis_name=route.axes)
    return out.reshape(buf.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _exchange(route: _Route, buf, send_sizes, recv_sizes):
    """_move of float rows (fill 0) whose transpose is the inverse exchange (sizes swapped):
    no reliance on a transpose rule of ragged_all_to_all."""
    return _move(route, buf, send_sizes, recv_sizes, 0)


def _exchange_fwd(route, buf, send_sizes, recv_sizes):
    return _move(route, buf, send_sizes, recv_sizes, 0), (send_sizes, recv_sizes)


def _exchange_bwd(route, res, g):
    send_sizes, recv_sizes = res
    return _move(route, g, recv_sizes, send_sizes, 0), None, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _send(route: _Route, r, x, order, starts, counts, recv_counts, local_id):
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
    rows = _exchange(route, send, send_sizes, recv_sizes).reshape(n * cap, -1)
    ids = _move(route, ids[..., None], send_sizes, recv_sizes, num_local).reshape(n * cap, 1)
    return valid, a, send_sizes, recv_sizes, rows, ids


def _one_round(route: _Route, r, x, w, w_gate, w_up, w_down, *routing):
    """Round r (see _send for the routing arrays): dispatch, this shard's experts on the
    received rows, the outputs back, combined with the router weights w [T K] in float32.
    Returns [T, D] float32."""
    n, cap = route.group, route.cap
    with jax.named_scope("dispatch"):
        valid, a, send_sizes, recv_sizes, rows, ids = _send(route, r, x, *routing)
    ones = jnp.ones((n * cap, 1), jnp.float32)  # router weights are applied by the sender
    out = dropless_local(rows, ids, ones, w_gate, w_up, w_down, 0,
                         grouped_matmul=route.grouped_matmul, block_size=route.block_size)
    with jax.named_scope("combine"):
        # outputs travel back in the compute dtype; weighted and summed in float32
        back = _exchange(route, out.astype(x.dtype).reshape(n, cap, -1), recv_sizes, send_sizes)
        weight = jnp.where(valid, w[a].astype(jnp.float32), 0.0)
        contrib = back.astype(jnp.float32) * weight[..., None]
        return jnp.zeros((x.shape[0], back.shape[-1]), jnp.float32).at[a // route.k].add(contrib)


def _blocked_round_grads(route: _Route, r, acc, gy, x, w, w_gate, w_up, w_down, *routing):
    """Round r's backward for the blocked kernel, written out (the transposes of _one_round)
    so that the expert-weight gradients of all rounds add into one set of float32
    accumulators inside the kernel (block_expert_mlp_accumulate). acc = (dx [T, D], dw [T K],
    d w_gate, d w_up, d w_down), float32; returns it updated. Recomputes the round's forward."""
    n, cap, k = route.group, route.cap, route.k
    dx, dw, *dweights = acc
    valid, a, send_sizes, recv_sizes, rows, ids = _send(route, r, x, *routing)
    ones = jnp.ones((n * cap, 1), jnp.float32)
    plan = blocked_rows(ids, ones, 0, route.num_local, route.block_size)
    out = block_expert_mlp(rows, plan[0], plan[1], w_gate, w_up, w_down, plan[2])
    back = _move(route, out.astype(x.dtype).reshape(n, cap, -1), recv_sizes, send_sizes, 0)
    g = gy[a // k]  # [n, cap, D] float32
    dw = dw.at[a].add(jnp.where(valid, jnp.sum(g * back.astype(jnp.float32), -1), 0.0))
    weight = jnp.where(valid, w[a].astype(jnp.float32), 0.0)
    g_out = _move(route, (g * weight[..., None]).astype(x.dtype), send_sizes, recv_sizes, 0)
    zeros = (jnp.zeros(rows.shape, jnp.float32), jnp.zeros(plan[1].shape, jnp.float32))
    g_rows, _, *dweights = block_expert_mlp_accumulate(
        (*zeros, *dweights), g_out.reshape(n * cap, -1), rows, *plan[:2], w_gate, w_up,
        w_down, plan[2])
    g_send = _move(route, g_rows.astype(x.dtype).reshape(n, cap, -1), recv_sizes, send_sizes, 0)
    dx = dx.at[a // k].add(jnp.where(valid[..., None], g_send.astype(jnp.float32), 0.0))
    return (dx, dw, *dweights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rounds(route: _Route, x, w, w_gate, w_up, w_down, order, starts, counts, recv_counts,
            local_id, rounds):
    """Sum over rounds 0..rounds-1 of _one_round: [T, D] float32. A custom_vjp whose backward
    loops over the rounds again, recomputing each (under jax.vjp; for the blocked kernel its
    transposes written out, _blocked_round_grads), so the residuals are the inputs (no
    per-round stacks: memory does not grow with the round count)."""
    return _rounds_fwd(route, x, w, w_gate, w_up, w_down, order, starts, counts, recv_counts,
                       local_id, rounds)[0]


def _rounds_fwd(route, x, w, w_gate, w_up, w_down, *plan):
    *routing, rounds = plan
    y = jax.lax.fori_loop(
        0, rounds, lambda r, y: y + _one_round(route, r, x, w, w_gate, w_up, w_down, *routing),
        jnp.zeros((x.shape[0], w_down.shape[-1]), jnp.float32))
    return y, (x, w, w_gate, w_up, w_down, *plan)


def _rounds_bwd(route, res, gy):
    x, w, w_gate, w_up, w_down, *plan = res
    *routing, rounds = plan
    diff = (x, w, w_gate, w_up, w_down)
    if route.grouped_matmul == "blocked":  # weight gradients summed inside the kernel
        grads = jax.lax.fori_loop(
            0, rounds, lambda r, acc: _blocked_round_grads(route, r, acc, gy, *diff, *routing),
            tuple(jnp.zeros(a.shape, jnp.float32) for a in diff))
        return (*(g.astype(a.dtype) for g, a in zip(grads, diff, strict=True)),
                *(None for _ in plan))

    # gradients summed over rounds in each input's own dtype: a float32 copy of the local
    # expert weights' gradients would be the largest buffer of the layer (one round, the
    # usual case, adds to zeros: exact)
    def step(r, acc):
        _, vjp = jax.vjp(lambda *a: _one_round(route, r, *a, *routing), *diff)
        return tuple(s + g for s, g in zip(acc, vjp(gy), strict=True))
    grads = jax.lax.fori_loop(0, rounds, step, tuple(jnp.zeros_like(a) for a in diff))
    return (*grads, *(None for _ in plan))


_rounds.defvjp(_rounds_fwd, _rounds_bwd)
