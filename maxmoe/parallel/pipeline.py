"""Pipeline parallelism over the `stage` logical axis: GPipe and circular schedules.

A stack of L layers is cut into P stages x V repeats: C = P V chunks in layer order, chunk
c = v P + p runs on stage p in pass v. Chunks may be unequal (model.pipeline_stage_layers, or
as even as possible): every stage runs `slots` = the longest chunk's layers per pass, shorter
chunks padded with masked identity slots (parallel/schedule.py.s PipelineSchedule says what that
costs). All stages run at once as one `vmap` over the stage dimension, mapped onto the
pipeline mesh axis (`spmd_axis_name`), so XLA partitions it and every stage keeps its own
weights; between iterations the activations move one stage along the ring (a collective
permute). Iteration t, stage p works on virtual microbatch i = t - p: microbatch i mod M on
its pass i div M. The ring brings the last stage's output to stage 0, which keeps it in the
microbatch's row of its input buffer and reads it back for its next pass M - P + 1 iterations
later (M >= P). That buffer is held per stage, so its reads at loop-varying rows stay on the
stage's own devices (one [M, B/M, S, D] buffer shared by the stages was all-gathered over
them every iteration).

- gpipe (V = 1): any M; bubble (P - 1) / (M + P - 1).
- circular (V > 1, M >= P): bubble (P - 1) / (V M + P - 1), V times smaller for the same M.

Each iteration's stage pass is rematerialised (per-iteration remat): the backward keeps only
the stage inputs, one microbatch's [B/M, S, D] per iteration (bf16 ones as float32 words of
their bytes, `stage_words.pack`), and recomputes the pass (one more forward of the pipelined
layers), so the weights each stage picked are not kept per iteration
(docs/performance/parallelism.md, "Pipeline memory at scale").

Outside the pipeline the stage axes split the batch like data (config.DEFAULT_RULES): the
embedding, dense layers, LM head, loss and MTP run once per row, each stage on its 1/P of the
rows, not the whole batch on every stage. The stages trace under `sharding.within_stages`,
where "batch" names the other batch axes alone: x enters as [B, S, D] split over all batch axes
and is regrouped into microbatches [M, B/M, S, D] split over the others (every stage holds
every microbatch's rows of its batch shard; stage 0 reads them), and leaves the same way.

Weights are stored in natural layer order (checkpoints do not depend on the stages), their
layer dim split over the pipeline axis in contiguous blocks where P divides it, else another
dim split over it (`sharding.stack_source_spec`). Each step regroups them into stage slots
(`stage_layout`) with collectives that move every byte once; only the stage dim is
constrained, the other dims keep their expert / fsdp / tensor split.

The MoE aux values are summed (expert load) or averaged over microbatches, which gives exactly
the whole batch's values: the balance losses are built from them after the pipeline
(model/router.py), so a pipelined step optimises the same loss as one device.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxmoe.parallel.replicas import stack_axes, stack_source
from maxmoe.parallel.row_groups import MAXED, ROOT_MEAN_SQUARE
from maxmoe.parallel.schedule import PipelineSchedule
from maxmoe.parallel.stage_words import pack, packs, stage_zero, unpack
from maxmoe.sharding import (
    current_mesh,
    entry_axes,
    mesh_axes,
    on_compute_copy,
    shard,
    spec,
    within_stages,
)

# aux values summed over microbatches (then averaged, expert_load kept a sum), or maxed
# (row_groups.MAXED: dispatch_rounds, the rounds the worst microbatch needed), or squared,
# summed and rooted (row_groups.ROOT_MEAN_SQUARE: activation_rms), as row groups and gradient
# accumulation combine them; other per-token outputs are dropped. The losses' inputs (z,
# sequence, load, affinity) are sums or means over equal groups of rows (model/router.py), so
# they equal the whole batch's; router_entropy, dropped_fraction and activation_rms (metrics
# only) are exactly the batch's too, as each microbatch has as many tokens.
_AUX_KEYS = ("z_loss", "sequence_balance_loss", "expert_load", "router_affinity",
             "router_entropy", "activation_rms", "dropped_fraction", "dispatch_rounds")


def num_stages() -> int:
    mesh = current_mesh()
    if mesh is None:
        return 1
    n = 1
    for axis in mesh_axes("stage"):
        n *= mesh.shape[axis]
    return n


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


def run_pipeline(stack, x, segment_ids, positions, *, run_layers, schedule: PipelineSchedule):
    """x [B, S, D] through all layers of `stack` (leading dim L) on the pipeline, as
    `schedule` (its stages = this mesh's; schedule.pipelines(L)) says.

    run_layers(graphdef, layer_state, h, segment_ids, positions, mask=None) -> (h, aux stacked
    per layer) runs a chunk of layers (scan + remat as configured); mask [slots] bool, given
    when chunks are unequal, makes the False slots identities. Returns (x, aux [L, ...]).

    x arrives and leaves split over the batch axes, the stage axes among them (outside the
    pipeline they split the rows too); the stages run under `within_stages`, where "batch"
    names the other axes alone, on the microbatch layout [M, B/M, ...].
    """
    graphdef, state = nnx.split(stack)
    table = schedule.slot_table(jax.tree.leaves(state)[0].shape[0])  # [P][V slots]: layer / -1
    stage_params = stage_layout(state, table, schedule.repeats)  # [P, V, slots, ...]
    pin = _gradients_pinned(stage_params)
    with within_stages():
        y, aux_sum = _run_schedule(graphdef, stage_params, table, x, segment_ids, positions,
                                   run_layers=run_layers, schedule=schedule, pin=pin)
    return shard(y, ("batch", "seq", "act_embed")), _natural_aux(aux_sum, table,
                                                                 schedule.microbatches)


def _gradients_pinned(stage_params):
    """On a compute copy (mesh.weights zero1 / hsdp): stage params -> the same, whose gradient
    at every pipeline iteration is constrained to the copy's stage layout (replicated over the
    data-parallel axes), so the scan's transpose sums it per device and XLA:GPU can reduce it
    once after the loop (train/gradients.py); left to itself XLA shards the sum and
    reduce-scatters every iteration. The identity otherwise."""
    if current_mesh() is None or not on_compute_copy():
        return lambda tree: tree
    specs = [spec(("stage", None, None, *stack_axes(v, 3)[3:]), shape=v.get_value().shape)
             for v in jax.tree.leaves(stage_params, is_leaf=lambda x: isinstance(x, nnx.Variable))]

    @jax.custom_vjp
    def pin(tree):
        return tree

    def backward(_, ct):
        leaves, tree = jax.tree.flatten(ct)
        return (tree.unflatten([jax.lax.with_sharding_constraint(c, s)
                                for c, s in zip(leaves, specs, strict=True)]),)

    pin.defvjp(lambda tree: (tree, None), backward)
    return pin


def _run_schedule(graphdef, stage_params, table, x, segment_ids, positions, *, run_layers,
                  schedule: PipelineSchedule, pin=lambda tree: tree):
    """run_pipeline's loop, traced under `within_stages`: the microbatches through the stages
    [P, V, slots, ...] of `stage_params`. Returns (y [B, S, D], aux summed per stage and pass
    [P, V, slots, ...])."""
    stages, repeats, m = schedule.stages, schedule.repeats, schedule.microbatches
    mask = np.asarray(table).reshape(stages, repeats, -1) >= 0
    padded, packed = not mask.all(), packs(x)
    xs, segs, poss = (_microbatches(a, m) for a in (x, segment_ids, positions))

    def stage_step(stage_chunks, stage_mask, h, seg, pos, v):
        """One stage: pick its chunk for pass v, run its layers (padding slots masked); h as
        `pack` packed it."""
        h = unpack(h, x.dtype) if packed else h
        params = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, v, 0, keepdims=False),
                              stage_chunks)
        slots = jax.lax.dynamic_index_in_dim(stage_mask, v, 0, keepdims=False)
        return run_layers(graphdef, params, h, seg, pos, mask=slots if padded else None)

    # per-iteration remat: the backward recomputes each stage's pass from its input, saved per
    # iteration as `pack` packs it. Without it, differentiating the scan over iterations keeps
    # what each iteration derived from its index, the weights each stage picked for its pass:
    # iterations x one stage's weights.
    stage_step = jax.checkpoint(stage_step, policy=jax.checkpoint_policies.nothing_saveable,
                                prevent_cse=False)
    stage_axes = mesh_axes("stage")
    all_stages = jax.vmap(stage_step, spmd_axis_name=stage_axes[0] if len(stage_axes) == 1
                          else (stage_axes or None))
    to_saved = functools.partial(pack, dtype=x.dtype) if packed else lambda h: h

    # `io` [P, M, ...], each stage's slice on its own devices (reads at loop-varying rows stay
    # local): stage 0's holds the microbatches (every stage holds xs), each row replaced by
    # the microbatch's output of the last stage once stage 0 has read it. Then the ring buffer
    first = (jnp.arange(stages) == 0).reshape(stages, 1, 1, 1)
    io = _per_stage(jnp.broadcast_to(xs, (stages, *xs.shape)))
    buf = shard(jnp.zeros((stages, *xs.shape[1:]), x.dtype), ("stage", "batch", "seq", "act_embed"))
    mask = jnp.asarray(mask)
    aux_sum = _aux_zeros(all_stages, stage_params, mask, to_saved(buf), segs, poss, repeats)

    def iteration(carry, t):
        buf, io, aux_sum = carry
        i = t - jnp.arange(stages)  # virtual microbatch of each stage
        valid = (i >= 0) & (i < repeats * m)
        micro = jnp.clip(i, 0, repeats * m - 1) % m
        v = jnp.clip(i, 0, repeats * m - 1) // m
        # stage 0 takes row t mod M: the microbatch itself on its first pass (t < M), else its
        # output of the last stage's previous pass, written at iteration t - M + P - 1 (M >= P)
        h_in = jnp.where(first, jax.lax.dynamic_index_in_dim(io, t % m, 1, keepdims=False), buf)
        h, aux = all_stages(pin(stage_params), mask, to_saved(h_in), segs[micro], poss[micro], v)
        weight = jax.nn.one_hot(v, repeats) * valid[:, None]  # [P, V]
        aux_sum = {k: _aux_add(k, acc, weight, aux[k]) for k, acc in aux_sum.items()}
        buf = shard(jnp.roll(h, 1, axis=0), ("stage", "batch", "seq", "act_embed"))
        # buf[0] now holds the last stage's output of virtual microbatch t - P + 1: stage 0
        # keeps it in io[0, its row mod M], read at iteration t - P + 1 (each stage writes
        # its own slice alike, unused). Before iteration P - 1 that is row 0, read at t = 0
        # and written for real at P - 1, before stage 0 reads it again (t = M >= P)
        row = jnp.maximum(t - stages + 1, 0) % m
        io = jax.lax.dynamic_update_index_in_dim(io, buf, row, 1)
        return (buf, io, aux_sum), None

    (_, io, aux_sum), _ = jax.lax.scan(iteration, (buf, io, aux_sum),
                                       jnp.arange(schedule.iterations))
    y = stage_zero(stages, io) if packed else jnp.sum(jnp.where(first[:, None], io, 0), axis=0)
    return y.swapaxes(0, 1).reshape(x.shape), aux_sum


def _microbatches(a: jax.Array, m: int) -> jax.Array:
    """[B, ...] split over the batch axes -> [M, B/M, ...]; microbatch j takes rows j, j + M,
    ... (first gathered over the stage axes, the last batch axes: the reshape stays local)."""
    a = shard(a, ("batch",) + (None,) * (a.ndim - 1))
    a = a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1)
    return shard(a, (None, "batch") + (None,) * (a.ndim - 2))


def _per_stage(a: jax.Array) -> jax.Array:
    """[P, M, rows, S, D]: stage p's [M, rows, S, D] on stage p's devices."""
    return shard(a, ("stage", None, "batch", "seq", "act_embed"))


def _aux_zeros(all_stages, stage_params, mask, h, segs, poss, repeats: int) -> dict:
    """Zeros [P, V, ...] for each _AUX_KEYS value the stages return (per stage and pass)."""
    stages = h.shape[0]
    shapes = jax.eval_shape(lambda: all_stages(
        stage_params, mask, h, jnp.zeros((stages, *segs.shape[1:]), segs.dtype),
        jnp.zeros((stages, *poss.shape[1:]), poss.dtype), jnp.zeros((stages,), jnp.int32))[1])
    return {k: jnp.zeros((stages, repeats, *s.shape[1:]), jnp.float32)
            for k, s in shapes.items() if k in _AUX_KEYS}


def _aux_add(key: str, acc, weight, value):
    """acc [P, V, ...] with one iteration's aux value [P, ...] added where weight [P, V] (0 or
    1: the stage's pass is a real microbatch) is 1: summed (ROOT_MEAN_SQUARE keys: their
    squares), or maxed for MAXED keys (their values are >= 0, so a 0 weight leaves acc)."""
    value = value.astype(jnp.float32)
    value = jnp.square(value) if key in ROOT_MEAN_SQUARE else value
    term = jnp.einsum("pv,p...->pv...", weight, value)
    return jnp.maximum(acc, term) if key in MAXED else acc + term


def _natural_aux(aux_sum: dict, table: list[list[int]], m: int) -> dict:
    """aux [P, V, slots, ...] summed (or maxed) over m microbatches -> the mean (expert_load:
    the sum; MAXED: the max; ROOT_MEAN_SQUARE: the root of the mean of the summed squares) of
    each real layer, in natural layer order [L, ...]; padding slots dropped."""
    flat = np.asarray(table).reshape(-1)
    where = jnp.asarray(np.argsort(np.where(flat >= 0, flat, flat.size))[:int((flat >= 0).sum())])
    out = {}
    for k, a in aux_sum.items():
        a = jnp.take(a.reshape(-1, *a.shape[3:]), where, axis=0)
        out[k] = (a if k == "expert_load" or k in MAXED  # a count, a max
                  else jnp.sqrt(a / m) if k in ROOT_MEAN_SQUARE else a / m)
    return out
