"""The work outside the pipelined layers over groups of rows (`model.outer_microbatches`).

Outside the pipeline (unpipelined layer stacks such as DeepSeek's dense prefix, the final norm,
LM head and loss, MTP) every device runs all its rows at once, so its temporaries grow with the
rows: at M >= 32 pipeline microbatches the rows per device outside are >= 32 (issue 25 item 3).
Here a lax.scan runs them G groups at a time, so the temporaries are one group's. The results
are exactly the whole batch's: losses are sums over rows (divided by the whole batch's token
counts, computed before the split), and each MoE aux value decomposes over equal groups of rows
(model/router.py): expert_load summed, dispatch_rounds maxed, activation_rms the root of the
mean square, the rest means. Per-token outputs (expert_idx) are dropped, as the pipeline does.
Capacity-mode MoE layers size their buffers per group, as pipelined layers do per microbatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxmoe.sharding import shard

# how values stacked over equal parts of a batch combine (combine_stacked): MAXED maxed,
# ROOT_MEAN_SQUARE the root of the mean square, the caller's summed keys added, the rest meaned
MAXED = ("dispatch_rounds",)
ROOT_MEAN_SQUARE = ("activation_rms", "dense_activation_rms")
_SUMMED = ("expert_load",)
_MEANED = ("z_loss", "sequence_balance_loss", "router_affinity", "router_entropy",
           "dropped_fraction")
# the split keeps these logical names on the trailing dims ([B, S] and [B, S, D] arrays)
_TRAILING = {1: (), 2: ("seq",), 3: ("seq", "act_embed")}


def split_rows(a: jax.Array, groups: int) -> jax.Array:
    """[B, ...] -> [G, B/G, ...]: group g takes rows g, g + G, ... Each batch shard's rows are
    contiguous, so with G dividing them every group has B/G/shards rows on every device and
    the regrouping moves nothing between devices."""
    rest = _TRAILING.get(a.ndim, (None,) * (a.ndim - 1))
    a = a.reshape(a.shape[0] // groups, groups, *a.shape[1:]).swapaxes(0, 1)
    return shard(a, (None, "batch", *rest))


def join_rows(a: jax.Array) -> jax.Array:
    """split_rows' inverse: [G, B/G, ...] -> [B, ...]."""
    a = a.swapaxes(0, 1).reshape(-1, *a.shape[2:])
    return shard(a, ("batch", *_TRAILING.get(a.ndim, (None,) * (a.ndim - 1))))


def kept_aux(aux: dict) -> dict:
    """The aux entries that combine over groups of rows (per-token ones dropped)."""
    return {k: v for k, v in aux.items() if k in _SUMMED + MAXED + ROOT_MEAN_SQUARE + _MEANED}


def combine_stacked(stacked: dict, summed: tuple = _SUMMED) -> dict:
    """{key: [G, ...]} stacked over G equal parts of a batch (row groups, microbatches) -> the
    whole batch's {key: [...]}: keys in `summed` added, MAXED maxed, ROOT_MEAN_SQUARE the root
    of the mean square, the rest the mean. The one rule for both row groups and gradient
    accumulation, so a new aux metric combines the same way in each."""
    out = {}
    for k, v in stacked.items():
        if k in summed:
            out[k] = jnp.sum(v, axis=0)
        elif k in MAXED:
            out[k] = jnp.max(v, axis=0)
        elif k in ROOT_MEAN_SQUARE:
            out[k] = jnp.sqrt(jnp.mean(jnp.square(v), axis=0))
        else:
            out[k] = jnp.mean(v, axis=0)
    return out


def over_row_groups(fn, groups: int, rows: tuple, summed_init, *, remat: bool = False):
    """Runs fn(*row_arrays) -> (out, summed, aux) on `groups` groups of rows in turn.

    rows: arrays [B, ...] (split by split_rows); out: [B/G, ...] arrays or None, joined back
    to [B, ...]; summed: a pytree of values added over the groups, starting from summed_init
    (e.g. loss sums); aux: {key: value} combined by combine_stacked (kept_aux's keys only).
    remat: fn under jax.checkpoint saving nothing, so the scan keeps only each group's inputs
    for the backward (else whatever fn's backward needs, e.g. float32 logits, is kept for
    every group: the whole batch's again). Returns (out, summed, aux)."""
    if remat:
        fn = jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable,
                            prevent_cse=False)

    def body(total, xs):
        out, summed, aux = fn(*xs)
        total = jax.tree.map(jnp.add, total, summed)
        return total, (out, kept_aux(aux))

    total, (out, aux) = jax.lax.scan(body, summed_init,
                                     tuple(split_rows(a, groups) for a in rows))
    out = None if out is None else jax.tree.map(join_rows, out)
    return out, total, combine_stacked(aux)
