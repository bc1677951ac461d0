"""The two-level dropless transport (moe.transport=two_level): across hosts once per token and
host, then inside each host to the devices holding the token's experts.

DeepSeek-V3's group-limited routing (moe.num_groups, moe.groups_per_token) sends each token to
at most groups_per_token expert groups. With the expert axis split as (H hosts x L devices a
host), device index h L + l, and whole groups on each host (H divides num_groups), a token
reaches at most groups_per_token hosts, and each host needs it once however many of its
experts the token picked. So:

- hop 1, across hosts: device (h, l) sends each token once to device (h', l) of every host h'
  holding one of its experts, with the token's K expert ids (those elsewhere marked empty) and
  router weights. A token goes to a host at most once, so the [H, T] slot buffers never
  overflow: static shapes and no rounds. Cross-host rows sent: at most T x groups_per_token
  (all_to_all sends T K).
- hop 2, inside the host (device (h', l) to (h', l')): the received rows are the tokens of an
  AllToAll exchange over the host's L devices (parallel/all_to_all.py's rounds: cap =
  ceil(c T K / L) slots per pair, a static round count enough for the worst routing of its
  H T rows, nothing dropped). Each row comes
  back weighted and summed over this host's experts (float32).
- combine: the per-host sums go back over hop 1 (in the compute dtype) and the sender adds
  its token's hosts' sums in float32.

Both hops are `lax.all_to_all` with `axis_index_groups` (hop 1 groups the devices of equal l,
hop 2 those of one host); with route.ragged, `lax.ragged_all_to_all` sends only the filled
rows of the same buffers (GPU/TPU; XLA:CPU cannot compile it, the dense form moves the same
buffers): one algorithm on every platform. Under the pipeline, whose vmap over the stages jax
cannot batch a grouped collective through, each grouped exchange is wrapped by
parallel/grouped.py's `batched_by_slices` (a custom vmap rule: one call per stage slice, so the
HLO and its bytes are the unpipelined ones).

Cross-host bytes against all_to_all: hop 1's buffers hold (H - 1) T rows bound for other
hosts, all_to_all's (ep - L) cap >= (H - 1) / H c T K per exchange, a ratio of at most
H / (c K) (c = moe.transport_buffer_factor); with H <= c groups_per_token that is at most
groups_per_token / K. The rows routing fills (what the ragged form sends) are at most T
groups_per_token (H - 1) / H against T K (H - 1) / H (docs/performance/parallelism.md, two_level
under
the pipeline).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxmoe.config import MoEConfig
from maxmoe.kernels.grouped_matmul import resolve_kernel
from maxmoe.parallel.all_to_all import (
    Route,
    dispatch_slots,
    exchange_counts,
    exchange_rounds,
    exchange_slots,
    move_slots,
    plan_rounds,
    worst_rounds,
)
from maxmoe.parallel.dispatch import Dispatched, Dispatcher, ExpertShards
from maxmoe.sharding import mesh_platform


class TwoLevel(Dispatcher):
    """Dropless two-hop dispatch over an expert axis of `hosts` hosts (see the module
    docstring). The exchange group (shards.gathered) is indexed host-major: member h L + l is
    device l of host h, as make_mesh lays out an axis's DCN (outer) x ICI (inner) factors.
    ragged: use lax.ragged_all_to_all (None: on any platform but CPU)."""

    def __init__(self, cfg: MoEConfig, shards: ExpertShards | None = None, hosts: int = 1,
                 ragged: bool | None = None):
        super().__init__(cfg, shards)
        self.hosts = hosts
        self.ragged = mesh_platform() != "cpu" if ragged is None else ragged

    def routes(self, t: int, k: int, num_local: int, dtype) -> tuple[Route, Route]:
        """(across, inside) for rows of `dtype`: hop 1's route (H members of equal l, [H, T]
        slots, the host's L El experts its 'local' ids) and hop 2's (the L devices of one
        host)."""
        cfg, n, hosts = self.cfg, self.shards.group, self.hosts
        per_host = n // hosts
        common = dict(axes=self.shards.gathered, k=k, ragged=self.ragged,
                      grouped_matmul=resolve_kernel(cfg.grouped_matmul, dtype),
                      block_size=cfg.block_size, fp8=self.fp8, amax=self.amax)
        across = Route(group=hosts, num_local=per_host * num_local, cap=t,
                       groups=tuple(tuple(h * per_host + j for h in range(hosts))
                                    for j in range(per_host)), **common)
        cap = max(1, math.ceil(cfg.transport_buffer_factor * t * k / per_host))
        inside = Route(group=per_host, num_local=num_local, cap=cap,
                       rounds=cfg.transport_rounds or worst_rounds(hosts * t, k, num_local, cap),
                       groups=tuple(tuple(h * per_host + j for j in range(per_host))
                                    for h in range(hosts)), **common)
        return across, inside

    def __call__(self, x, expert_idx, weights, w_gate, w_up, w_down) -> Dispatched:
        x = x.reshape(-1, x.shape[-1])
        t, k = expert_idx.shape
        across, inside = self.routes(t, k, w_gate.shape[0], x.dtype)
        with jax.named_scope("dispatch"):
            src, counts, rows, ids, w = _pack_hosts(across, self.shards, x, expert_idx,
                                                    weights)
            recv_counts = exchange_counts(across, counts)
            # [H, T, D] from each host; E4M3 under precision.fp8 (all_to_all.dispatch_slots)
            rows = dispatch_slots(across, rows, counts, recv_counts)
            w = exchange_slots(across, w, counts, recv_counts)  # [H, T, K]
            ids = move_slots(across, ids, counts, recv_counts, across.num_local)
            # what crossed hosts, kept by model.remat_policy=save_received (model/block.py)
            rows, w, ids, recv_counts = (checkpoint_name(a, "moe_received")
                                         for a in (rows, w, ids, recv_counts))
            flat = ids.reshape(-1)  # expert within this host; num_local of across: empty
            dev = flat // inside.num_local  # L (empty): never sent
            routing, needed, dropped = plan_rounds(inside, dev, flat - dev * inside.num_local)
        hosts, d = across.group, x.shape[-1]
        y = exchange_rounds(inside, rows.reshape(hosts * t, d), w.reshape(-1), w_gate, w_up,
                            w_down, *routing)  # [H T, D] float32: this host's experts, weighted
        with jax.named_scope("combine"):
            back = exchange_slots(across, y.astype(x.dtype).reshape(hosts, t, d), recv_counts,
                             counts)
            out = jnp.zeros((t, d), jnp.float32).at[src].add(back.astype(jnp.float32),
                                                             mode="drop")
        return Dispatched(out, dropped, needed.astype(jnp.int32))


def _pack_hosts(across: Route, shards: ExpertShards, x, expert_idx, weights):
    """Hop 1's send buffers: each token once per destination host, in token order.

    x [T, D]; expert_idx, weights [T, K]. Returns (src [H, T] the token in each slot, T if
    empty; counts [H] filled slots per host; rows [H, T, D]; ids [H, T, K] each assignment's
    expert within the host, across.num_local where it lies on another host or the slot is
    empty; w [H, T, K] the router weights there, 0 elsewhere)."""
    t, k = expert_idx.shape
    hosts, host_experts = across.group, across.num_local
    per_host = shards.group // hosts
    dst, mine = shards.destination(expert_idx // (host_experts // per_host))
    host = jnp.where(mine, dst // per_host, hosts)  # [T, K]; hosts: another shard group's
    need = jnp.any(host[:, :, None] == jnp.arange(hosts), axis=1)  # [T, H]
    slot = jnp.where(need, jnp.cumsum(need, axis=0) - 1, t)  # t: not sent there
    counts = jnp.sum(need, axis=0).astype(jnp.int32)
    src = jnp.full((hosts, t), t, jnp.int32).at[jnp.arange(hosts)[None, :], slot].set(
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], slot.shape), mode="drop")
    valid = src < t
    tok = jnp.minimum(src, t - 1)
    rows = jnp.where(valid[..., None], x[tok], jnp.zeros((), x.dtype))
    on = (host[tok] == jnp.arange(hosts)[:, None, None]) & valid[..., None]  # [H, T, K]
    first = (jnp.arange(hosts) * host_experts)[:, None, None]
    ids = jnp.where(on, expert_idx[tok] - first, host_experts).astype(jnp.int32)
    w = jnp.where(on, weights[tok], jnp.zeros((), weights.dtype))
    return src, counts, rows, ids, w
