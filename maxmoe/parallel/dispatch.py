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
  Assignments beyond cap go in later rounds; the round count is static (no host sync on GPU):
  enough for the worst routing, so nothing is dropped under any routing, or
  moe.transport_rounds, whose overflow is dropped and counted (parallel/all_to_all.py). The
  exchange is `lax.ragged_all_to_all` on GPU/TPU and a dense `lax.all_to_all` of the same
  [ep, cap, D] buffers on CPU (XLA:CPU cannot compile the ragged one); the slots, rounds and
  combine are one code path for both.
- `TwoLevel` (dropless, parallel/two_level.py): under group-limited routing, each token once
  to each host holding its experts (static [H, T] buffers, no rounds), then an AllToAll inside
  the host; the cross-host rows are at most T x groups_per_token instead of T K.
- `Capacity` (may drop): GShard/Switch slot buffers per expert, one all-to-all each way
  (parallel/capacity.py).
- `Chunked` (moe.overlap_chunks): a dropless dispatcher run on independent token chunks, so
  that XLA:GPU overlaps one chunk's exchanges with another's expert GEMMs.

The rounds of AllToAll (slots, exchange, combine, their custom VJP) are parallel/all_to_all.py.
Under precision.fp8 (`Dispatcher.fp8`, either mode) every dispatcher sends the tokens in E4M3
1x128 tiles with float32 scales (kernels/fp8.e4m3_wire: DeepSeek-V3's FP8 dispatch, about half
of bf16's bytes) and the combine in the compute dtype; the blockwise expert GEMMs requantise
the arrived rows to the same E4M3 values, so the wire adds no error there.

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
from maxmoe.kernels.fp8 import NO_AXES, e4m3_wire
from maxmoe.kernels.grouped_matmul import dropless_local, resolve_kernel
from maxmoe.parallel.all_to_all import Route, exchange_rounds, plan_rounds, worst_rounds
from maxmoe.sharding import mesh_platform

# auto: all_gather while the expert axis has at most this many shards (a host's GPUs) and
# lies inside one host (NVLink); all_to_all otherwise. all_gather's buffers hold T ep rows,
# all_to_all's c T K: below ep = c K (12 for DeepSeek-V3's K 8 at c 1.5) all_gather's are the
# smaller ones (docs/performance/parallelism.md, Expert-parallel transports)
AUTO_ALL_GATHER_MAX_EP = 8


def choose_transport(moe: MoEConfig, ep: int, ep_hosts: int) -> str:
    """The dropless transport for an expert axis of `ep` shards spread over `ep_hosts` hosts:
    moe.transport unless it is auto; auto = all_gather if ep <= AUTO_ALL_GATHER_MAX_EP and
    ep_hosts == 1, else all_to_all. auto never picks two_level: it saves cross-host bytes but
    its hop-1 buffers come on top of all_to_all's, and memory is what binds the target
    layouts (docs/performance/parallelism.md, Expert-parallel transports)."""
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
    """cfg with moe.transport=auto replaced by the transport it picks on this layout, and for
    two_level moe.expert_hosts=0 by the hosts of the expert axis (the DCN factors of the
    config count the hosts, so a one-process planner compile of a multi-host layout builds
    what the cluster will run)."""
    ep, hosts = expert_axis_sizes(cfg, mesh_sizes)
    transport = choose_transport(cfg.moe, ep, hosts)
    expert_hosts = (cfg.moe.expert_hosts or hosts) if transport == "two_level" else \
        cfg.moe.expert_hosts
    moe = dataclasses.replace(cfg.moe, transport=transport, expert_hosts=expert_hosts)
    return dataclasses.replace(cfg, moe=moe)


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
    extra = (f", buffer factor {moe.transport_buffer_factor}, " + (
        f"{moe.transport_rounds} static rounds (overflow dropped, counted in dropped_fraction)"
        if moe.transport_rounds else "static rounds for any routing (nothing dropped)")
        if how in ("all_to_all", "two_level") else "")
    if how == "two_level":
        extra += f", {moe.expert_hosts or hosts} hosts x {ep // (moe.expert_hosts or hosts)}"
    if moe.overlap_chunks > 1:
        extra += f", {moe.overlap_chunks} token chunks (one's exchanges under another's GEMMs)"
    return f"moe dispatch: dropless, transport {how} over {ep} expert shards ({why}){extra}"


@dataclasses.dataclass(frozen=True)
class ExpertShards:
    """Where this device sits on the expert axes (inside shard_map).

    axes: the mesh axes of the logical `experts` axis, in order; sizes: their sizes.
    gathered: those that also shard the batch (tokens must travel over them); the others hold
    the same tokens on every shard (each keeps its own experts' assignments, and the caller
    sums over them). sync: every axis but the pipeline's (routed_experts' choice), which a
    tensorwise FP8 amax of the rows spans.
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
    rounds: jax.Array  # int: exchange rounds the data filled (1 for single-exchange ones)


class Dispatcher:
    """Base: cfg (the MoE config) and shards (this device's place on the expert axes)."""
    fp8 = "none"  # precision.fp8 of the expert GEMMs (kernels/fp8.py), set by routed_experts
    amax = NO_AXES  # the mesh axes a tensorwise amax spans (kernels/fp8.AmaxAxes), likewise

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
        x = self.gather_tokens(x)
        if gathered:
            expert_idx, weights = (jax.lax.all_gather(a, gathered, axis=0, tiled=True)
                                   for a in (expert_idx, weights))
        y = dropless_local(x, expert_idx, weights, w_gate, w_up, w_down, first,
                           grouped_matmul=cfg.grouped_matmul, block_size=cfg.block_size,
                           fp8=self.fp8, amax=self.amax)
        if gathered:
            y = jax.lax.psum_scatter(y, gathered, scatter_dimension=0, tiled=True)
        return Dispatched(y, jnp.zeros((), jnp.int32), _one())

    def gather_tokens(self, x):
        """x [T, D] all-gathered over the gathered axes; under precision.fp8 (either mode) in
        E4M3 1x128 tiles with float32 scales (kernels/fp8.e4m3_wire; the gradient comes back
        reduce-scattered in x's dtype), rounded in place where nothing travels."""
        gathered = self.shards.gathered
        if self.fp8 == "none":
            return jax.lax.all_gather(x, gathered, axis=0, tiled=True) if gathered else x
        if not gathered:
            return e4m3_wire(None, None, x)
        move = functools.partial(jax.lax.all_gather, axis_name=gathered, axis=0, tiled=True)
        back = functools.partial(jax.lax.psum_scatter, axis_name=gathered, scatter_dimension=0,
                                 tiled=True)
        return e4m3_wire(move, back, x)


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
        cap = max(1, math.ceil(cfg.transport_buffer_factor * t * k / n))
        route = Route(axes=shards.gathered, group=n, k=k, num_local=num_local, cap=cap,
                      ragged=self.ragged,
                      grouped_matmul=resolve_kernel(cfg.grouped_matmul, x.dtype),
                      block_size=cfg.block_size,
                      rounds=cfg.transport_rounds or worst_rounds(t, k, num_local, cap),
                      fp8=self.fp8, amax=self.amax)
        with jax.named_scope("dispatch"):
            shard = expert_idx.reshape(-1) // num_local
            dst, mine = shards.destination(shard)
            key = jnp.where(mine, dst, n)  # n: another shard group's expert, never sent
            local_id = expert_idx.reshape(-1) - shard * num_local  # expert within its shard
            routing, needed, dropped = plan_rounds(route, key, local_id)
        y = exchange_rounds(route, x, weights.reshape(-1), w_gate, w_up, w_down, *routing)
        return Dispatched(y, dropped, needed.astype(jnp.int32))


class Chunked(Dispatcher):
    """moe.overlap_chunks n > 1: the device's T rows in n contiguous chunks (jnp.array_split), each
    dispatched, run and combined by `inner` on its own, the outputs concatenated (dropped
    summed, rounds the max). The chunks' exchanges share no data, so XLA:GPU's latency-hiding
    scheduler can run one chunk's dispatch or combine under another chunk's expert GEMMs: the
    overlap DualPipe and Megatron-Core's 1F1B A2A overlap get from two micro-batches, inside one
    MoE layer. A dropless inner gives the same outputs as one chunk (a row's output depends on
    its own assignments only); what differs per chunk: the slots per pair (cap) and, under
    moe.transport_rounds N, the overflow dropped; a tensorwise FP8 amax spans one chunk.
    """

    def __init__(self, inner: Dispatcher, chunks: int):  # inner's fp8 and amax already set
        super().__init__(inner.cfg, inner.shards)
        self.inner, self.chunks = inner, chunks

    def __call__(self, x, expert_idx, weights, w_gate, w_up, w_down) -> Dispatched:
        x = x.reshape(-1, x.shape[-1])
        n = min(self.chunks, x.shape[0])  # rows not a multiple of n: the first chunks 1 longer
        parts = [self.inner(*rows, w_gate, w_up, w_down) for rows in zip(
            *(jnp.array_split(a, n) for a in (x, expert_idx, weights)), strict=True)]
        return Dispatched(jnp.concatenate([p.y for p in parts]), sum(p.dropped for p in parts),
                          functools.reduce(jnp.maximum, [p.rounds for p in parts]))

