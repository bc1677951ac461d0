"""The pipeline's weights in stage slots: each step regroups the stacked layer params, stored in
natural layer order, into [P, V, slots, ...] as parallel/schedule.PipelineSchedule.slot_table
places them (parallel/pipeline.py runs them).

Stored, a stack's layer dim is split over the pipeline axis in contiguous blocks where P
divides it, else another dim is split over it (`sharding.stack_source_spec`), so checkpoints do
not depend on the stages. The regrouping moves every weight byte at most once; only the stage
dim is constrained, the other dims keep their expert / fsdp / tensor split.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxmoe.parallel.replicas import stack_axes, stack_source
from maxmoe.sharding import current_mesh, entry_axes, mesh_axes, spec


def _constrain(a: jax.Array, logical: tuple) -> jax.Array:
    """with_sharding_constraint by logical names, dropping axes that do not divide a dim (as
    the params' own shardings do); identity without a mesh."""
    if current_mesh() is None:
        return a
    return jax.lax.with_sharding_constraint(a, spec(logical, shape=a.shape))


def slot_permutes(table: list[list[int]], block: int) -> list[tuple[int, int, int, list]]:
    """The collective permutes that move a stack stored in natural order to the stage slots.

    table[p][s]: the natural layer in slot s of stage p, -1 for padding (PipelineSchedule.
    slot_table). Stored, stage q holds layers q block ... q block + block - 1. Returns
    (r, s, n, [(q, p), ...]): rows r..r+n-1 of every source q go to slots s..s+n-1 of its p.
    Each entry pairs distinct sources with distinct destinations (a partial permutation), every
    real slot receives once, and runs of neighbouring layers with the same pairs are merged
    (equal circular chunks move as whole chunks)."""
    moves: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for p, row in enumerate(table):
        for slot, layer in enumerate(row):
            if layer >= 0:
                q, r = divmod(layer, block)
                moves.setdefault((r, slot), []).append((q, p))
    out: list[tuple[int, int, int, list]] = []
    for r, slot in sorted(moves, key=lambda rs: (rs[1] - rs[0], rs[0])):  # diagonals together
        pairs = sorted(moves[r, slot])
        if out and out[-1][3] == pairs and (out[-1][0] + out[-1][2], out[-1][1] + out[-1][2]) \
                == (r, slot):
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1, pairs)
        else:
            out.append((r, slot, 1, pairs))
    return out


def _entry(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _stage_slots(a: jax.Array, source: tuple | None, table: list[list[int]]) -> jax.Array:
    """[L, ...] in natural layer order, read with PartitionSpec `source` (`sharding.
    stack_source_spec`; None without a mesh) -> [P S, ...]: rows p S ... p S + S - 1 hold
    stage p's slots as `table` [P][S] names them, zeros in padding slots.

    Each case moves every weight byte at most once, in a shard_map; XLA's partitioner, asked
    for the same regrouping as a reshape and transpose, replicated the whole stack on every
    device first. The layer dim split over the stage axes (contiguous blocks, as stored when
    P | L): collective permutes (`slot_permutes`). The layer dim whole (e.g. 58 layers on 16
    stages): where another dim is split over the stage axes (their minor part; the source
    spec puts them where the state is stored), an all-to-all hands each stage its slots'
    slices; else each stage picks its slots from the whole stack, with no traffic. Anything
    else (no mesh; other splits): a plain gather."""
    index = np.asarray(table)
    layers = a.shape[0]
    if np.array_equal(index.reshape(-1), np.arange(layers)):
        return a  # equal gpipe chunks: the stored order already is the stage order
    stage_axes = mesh_axes("stage")
    pspec = tuple(source or ()) + (None,) * (a.ndim - len(source or ()))
    # numpy constants: a jax array closed over by a shard_map body keeps the outer mesh
    keep = (index.reshape(-1) >= 0).reshape(-1, *([1] * (a.ndim - 1)))
    rows = np.maximum(index, 0)
    if not stage_axes:
        return jnp.where(keep, jnp.take(a, rows.reshape(-1), axis=0), 0)
    axis = _entry(tuple(stage_axes))
    where = [d for d, entry in enumerate(pspec) if set(entry_axes(entry)) & set(stage_axes)]
    run = functools.partial(jax.shard_map, in_specs=jax.sharding.PartitionSpec(*pspec),
                            check_vma=False)  # off as in parallel/experts.py (the vmap)
    if where == [0] and entry_axes(pspec[0]) == tuple(stage_axes):
        return run(functools.partial(_permute_rows, table=table, axis=axis),
                   out_specs=jax.sharding.PartitionSpec(*pspec))(a)
    if pspec[0] is None and not where:
        def pick(whole):  # [L, ...] on every stage: take this stage's slots
            q = jax.lax.axis_index(axis)
            mine = jnp.take(whole, jnp.asarray(rows)[q], axis=0)
            return jnp.where(jnp.asarray(keep.reshape(*index.shape, *keep.shape[1:]))[q], mine, 0)
        return run(pick, out_specs=jax.sharding.PartitionSpec(axis, *pspec[1:]))(a)
    d = where[0] if len(where) == 1 else None
    if pspec[0] is None and d and entry_axes(pspec[d])[-len(stage_axes):] == tuple(stage_axes):
        def exchange(local):  # [L, ...], dim d a slice: send each stage its slots of it
            sent = jnp.where(keep, jnp.take(local, rows.reshape(-1), axis=0), 0)
            return jax.lax.all_to_all(sent, axis, 0, d, tiled=True)
        out = list(pspec)
        out[0], out[d] = axis, _entry(entry_axes(pspec[d])[:-len(stage_axes)])
        return run(exchange, out_specs=jax.sharding.PartitionSpec(*out))(a)
    return jnp.where(keep, jnp.take(a, rows.reshape(-1), axis=0), 0)


def _permute_rows(local, *, table, axis):
    """shard_map body: this stage's stored layers [L/P, ...] -> its slots [S, ...]."""
    stages, width = len(table), len(table[0])
    out = jnp.zeros((width, *local.shape[1:]), local.dtype)
    for r, slot, n, pairs in slot_permutes(table, local.shape[0]):
        moved = local[r:r + n]
        if pairs != [(q, q) for q in range(stages)]:
            moved = jax.lax.ppermute(moved, axis, pairs)
        out = out.at[slot:slot + n].add(moved)
    return out


def stage_layout(state, table: list[list[int]], repeats: int):
    """Stacked layer params [L, ...] (natural order, as stored) -> [P, V, slots, ...]: stage p,
    pass v, slot k holds layer table[p][v slots + k] (zeros for padding). The trailing dims
    keep their own sharding (expert, fsdp, tensor): only the stage dim is constrained, so no
    weight is gathered whole."""
    stages, width = len(table), len(table[0])

    def one(var):
        a, logical = var.get_value(), stack_axes(var, 1)
        a = _stage_slots(a, stack_source(var) if current_mesh() is not None else None, table)
        a = a.reshape(stages, repeats, width // repeats, *a.shape[1:])
        return var.replace(_constrain(a, ("stage", None, None, *logical[1:])))
    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
