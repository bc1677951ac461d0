"""Routed-expert computation, expert-parallel over the mesh: dropless or capacity-bounded.

Inside `shard_map` every device holds its batch shard of tokens and E/ep of the experts
(ep = size of the mesh axes the logical `experts` axis maps to). `routed_experts` builds the
shard_map and hands the tokens to a dispatcher (parallel/dispatch.py, one class per strategy):

- dropless, moe.transport all_gather (`AllGather`): tokens are all-gathered over the expert
  axis, each device runs the (token, k) assignments that hit its own experts as a grouped
  matmul (kernels/grouped_matmul.py) and reduce-scatters the partial outputs back. Moves each
  token once rather than once per k; buffers of T ep rows, so it suits small expert axes.
- dropless, moe.transport all_to_all (`AllToAll`): each assignment goes once to its expert's
  shard and back, in rounds of a fixed slot count per (source, destination) pair; buffers of
  c T K rows whatever ep; nothing dropped (static rounds enough for any routing).
- dropless, moe.transport two_level (`TwoLevel`, parallel/two_level.py): under group-limited
  routing, each token once to each host holding its experts, then inside the host to their
  devices (DeepSeek-V3's node-limited dispatch).
- capacity (`Capacity`, parallel/capacity.py): every device packs its own assignments into
  `capacity` slots per expert (GShard/Switch), exchanged with one all-to-all each way over the
  expert axis; slots counted per sequence, the overflow dropped.

All return (y [B, S, D], stats: dropped fraction of (token, k) assignments, exchange rounds).
moe.overlap_chunks N > 1 runs the dropless dispatcher on N independent token chunks of each
device's rows (`Chunked`), so XLA:GPU can schedule one chunk's exchanges under another's GEMMs.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxmoe.config import MoEConfig
from maxmoe.kernels.fp8 import AmaxAxes
from maxmoe.parallel.capacity import Capacity
from maxmoe.parallel.dispatch import (
    AllGather,
    AllToAll,
    Chunked,
    Dispatcher,
    ExpertShards,
    choose_transport,
)
from maxmoe.parallel.two_level import TwoLevel
from maxmoe.sharding import current_mesh, mesh_axes, replica_axes


def routed_experts(x, expert_idx, weights, w_gate, w_up, w_down, cfg: MoEConfig,
                   fp8: str = "none"):
    """x [B, S, D]; expert_idx, weights [B, S, K]; expert weights [E, D, F] / [E, F, D].

    Returns (y [B, S, D] in x.dtype, stats): stats["dropped_fraction"] (of the (token, k)
    assignments) and stats["dispatch_rounds"] (exchange rounds the routing filled, max over
    devices). Picks the dispatcher (parallel/dispatch.py) by moe.dispatch and moe.transport.
    Without a mesh or on a one-device mesh no shard_map is built: its transpose would
    all-reduce the expert weight gradients over the size-1 axes, which XLA:CPU runs as copies.
    fp8: precision.fp8, the expert GEMMs' FP8 mode (kernels/fp8.py), on every dispatcher; not
    none, the tokens also travel to their experts in E4M3 1x128 tiles with float32 scales
    (DeepSeek-V3's FP8 dispatch, kernels/fp8.e4m3_wire; rounded in place where they do not
    travel), while the combine and the gradients stay in x's dtype.
    """
    b, s, d = x.shape
    total = b * s * expert_idx.shape[-1]
    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        idx, w = expert_idx.reshape(b * s, -1), weights.reshape(b * s, -1)
        dispatcher = Capacity(cfg, seq_len=s) if cfg.dispatch == "capacity" else AllGather(cfg)
        dispatcher.fp8 = fp8
        # x itself, not reshaped: the same array as the router's input, one residual for both
        y, dropped, rounds = dispatcher(x, idx, w, w_gate, w_up, w_down)
        return y.astype(x.dtype).reshape(b, s, d), _stats(dropped, rounds, total)

    batch, ep, tp = mesh_axes("batch"), mesh_axes("experts"), mesh_axes("expert_mlp")
    # (stage and replica axes excluded: under the pipeline's vmap each stage has its own
    # tokens, under parallel/replicas.py's each device group)
    replicas = replica_axes(inside=True)
    others = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in batch
                   and a not in mesh_axes("stage") + replicas)
    shards = ExpertShards(axes=ep, sizes=tuple(mesh.shape[a] for a in ep),
                          gathered=tuple(a for a in ep if a in batch),
                          sync=tuple(a for a in batch + others + replicas
                                     if a in mesh.axis_names))
    dispatcher = _dispatcher(cfg, shards, mesh, s)
    # a tensorwise amax spans every axis but the pipeline's (tokens over the batch axes, experts
    # over the expert axes, the hidden's F over the tensor axes); a weight's, its F split
    dispatcher.fp8, dispatcher.amax = fp8, AmaxAxes(rows=shards.sync, weights=tp)
    if cfg.overlap_chunks > 1:  # chunks whose exchanges overlap each other's GEMMs
        dispatcher = Chunked(dispatcher, cfg.overlap_chunks)
    replicated = tuple(a for a in ep if a not in batch)  # tokens already present everywhere
    tok = P(batch or None, None, None)
    wspec_in = P(ep or None, None, tp or None)
    wspec_out = P(ep or None, tp or None, None)

    # check_vma off: under the pipeline's vmap (spmd_axis_name) the varying-axes inference
    # wrongly flags outputs as varying over the stage axis; the equivalence tests pin the specs
    @functools.partial(jax.shard_map, in_specs=(tok, tok, tok, wspec_in, wspec_in, wspec_out),
                       out_specs=(tok, P(), P()), check_vma=False)
    def body(x, idx, w, wg, wu, wd):
        b, s, d = x.shape
        y, dropped, rounds = dispatcher(x.reshape(-1, d), idx.reshape(b * s, -1),
                                        w.reshape(b * s, -1), wg, wu, wd)
        if replicated + tp:
            y = jax.lax.psum(y, replicated + tp)
        # each batch shard counts its own tokens once; other axes hold identical counts
        dropped = jax.lax.psum(dropped, batch) if batch else dropped
        dropped = jax.lax.pmax(dropped, others) if others else dropped
        rounds = jax.lax.pmax(rounds, batch + others) if batch + others else rounds
        return y.astype(x.dtype).reshape(b, s, d), dropped, rounds

    y, dropped, rounds = body(x, expert_idx, weights, w_gate, w_up, w_down)
    return y, _stats(dropped, rounds, total)


def _stats(dropped, rounds, total: int) -> dict:
    return {"dropped_fraction": jnp.asarray(dropped, jnp.float32) / total,
            "dispatch_rounds": jnp.asarray(rounds, jnp.float32)}


def _dispatcher(cfg: MoEConfig, shards: ExpertShards, mesh, seq_len: int) -> Dispatcher:
    """The dispatcher of moe.dispatch / moe.transport on this mesh (auto: choose_transport with
    the hosts the expert axes span, counted from the devices' processes; two_level: over
    moe.expert_hosts hosts, else that count)."""
    if cfg.dispatch == "capacity":
        return Capacity(cfg, shards, seq_len)
    if not shards.axes:  # experts not split: every shard runs them all, nothing travels
        return AllGather(cfg, shards)
    ep = math.prod(shards.sizes)
    # the processes along the expert axes, seen from the first device of the other axes
    along = mesh.devices[tuple(slice(None) if a in shards.axes else 0 for a in mesh.axis_names)]
    hosts = len({d.process_index for d in along.flat})
    transport = choose_transport(cfg, ep, hosts)
    if transport == "two_level":
        return TwoLevel(cfg, shards, hosts=cfg.expert_hosts or hosts)
    return AllToAll(cfg, shards) if transport == "all_to_all" else AllGather(cfg, shards)
