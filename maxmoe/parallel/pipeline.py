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

Each iteration's stage pass is rematerialised (per-iteration remat): the loop keeps only the
stage inputs for its backward, one microbatch's [B/M, S, D] per iteration (bf16 ones as
float32 words of their bytes, `stage_words.pack`), and recomputes the pass, so the weights
each stage picked are not kept per iteration (docs/performance/parallelism.md, "Pipeline
memory at scale"). The loop's backward is its own (`_Loop`, a custom VJP): under a block
remat it re-runs each iteration's slots one backward iteration ahead, beside another
microbatch's backward, so each one's MoE exchanges can run under the other's compute
(docs/performance/gpu.md, "The re-run ahead").

Outside the pipeline the stage axes split the batch like data (config.DEFAULT_RULES): the
embedding, dense layers, LM head, loss and MTP run once per row, each stage on its 1/P of the
rows, not the whole batch on every stage. The stages trace under `sharding.within_stages`,
where "batch" names the other batch axes alone: x enters as [B, S, D] split over all batch axes
and is regrouped into microbatches [M, B/M, S, D] split over the others (every stage holds
every microbatch's rows of its batch shard; stage 0 reads them), and leaves the same way.

Weights are stored in natural layer order (checkpoints do not depend on the stages); each step
regroups them into stage slots (parallel/stage_weights.stage_layout).

The MoE aux values are summed (expert load) or averaged over microbatches, which gives exactly
the whole batch's values: the balance losses are built from them after the pipeline
(model/router.py), so a pipelined step optimises the same loss as one device.
"""

from __future__ import annotations

import contextvars

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax._src import core as jax_core  # the axis env (spmd axis names): _Loop._bwd

from maxmoe.parallel.replicas import stack_axes
from maxmoe.parallel.row_groups import MAXED, ROOT_MEAN_SQUARE
from maxmoe.parallel.schedule import PipelineSchedule
from maxmoe.parallel.stage_weights import stage_layout
from maxmoe.parallel.stage_words import pack, packs, stage_zero, unpack
from maxmoe.sharding import (
    current_mesh,
    mesh_axes,
    on_compute_copy,
    shard,
    spec,
    within_stages,
)

# the named scope of the backward's re-run of a pass ahead (_Loop)
AHEAD_SCOPE = "rerun_ahead"
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


def run_pipeline(stack, x, segment_ids, positions, *, run_layers, schedule: PipelineSchedule,
                 ahead: bool = True):
    """x [B, S, D] through all layers of `stack` (leading dim L) on the pipeline, as
    `schedule` (its stages = this mesh's; schedule.pipelines(L)) says.

    run_layers(graphdef, layer_state, h, segment_ids, positions, mask=None) -> (h, aux stacked
    per layer) runs a chunk of layers (scan + remat as configured; any number of a stage's
    slots); mask [slots] bool, given when chunks are unequal, makes the False slots
    identities. Returns (x, aux [L, ...]).

    x arrives and leaves split over the batch axes, the stage axes among them (outside the
    pipeline they split the rows too); the stages run under `within_stages`, where "batch"
    names the other axes alone, on the microbatch layout [M, B/M, ...].
    """
    graphdef, state = nnx.split(stack)
    table = schedule.slot_table(jax.tree.leaves(state)[0].shape[0])  # [P][V slots]: layer / -1
    stage_params = stage_layout(state, table, schedule.repeats)  # [P, V, slots, ...]
    pins = _gradient_specs(stage_params)
    with within_stages():
        y, aux_sum = _run_schedule(graphdef, stage_params, table, x, segment_ids, positions,
                                   run_layers=run_layers, schedule=schedule, pins=pins,
                                   ahead=ahead)
    return shard(y, ("batch", "seq", "act_embed")), _natural_aux(aux_sum, table,
                                                                 schedule.microbatches)


def _gradient_specs(stage_params) -> list | None:
    """On a compute copy (mesh.weights zero1 / hsdp): the specs the pipeline loop's gradient
    sum of each float stage param is held in, the copy's stage layout (replicated over the
    data-parallel axes), so it sums per device and XLA:GPU reduces it once after the loop
    (train/gradients.py); left to itself XLA shards the sum and reduce-scatters every
    iteration. None otherwise (no constraint)."""
    if current_mesh() is None or not on_compute_copy():
        return None
    return [spec(("stage", None, None, *stack_axes(v, 3)[3:]), shape=v.get_value().shape)
            for v in jax.tree.leaves(stage_params, is_leaf=lambda x: isinstance(x, nnx.Variable))
            if jnp.issubdtype(v.get_value().dtype, jnp.inexact)]


def _run_schedule(graphdef, stage_params, table, x, segment_ids, positions, *, run_layers,
                  schedule: PipelineSchedule, pins=None, ahead: bool = True):
    """run_pipeline's loop, traced under `within_stages`: the microbatches through the stages
    [P, V, slots, ...] of `stage_params`. Returns (y [B, S, D], aux summed per stage and pass
    [P, V, slots, ...])."""
    stages, packed = schedule.stages, packs(x)
    loop = _Loop(graphdef, np.asarray(table).reshape(stages, schedule.repeats, -1) >= 0,
                 x.dtype, packed, run_layers, schedule, pins, ahead)
    xs, segs, poss = (_microbatches(a, schedule.microbatches) for a in (x, segment_ids, positions))
    # `io` [P, M, ...], each stage's slice on its own devices (reads at loop-varying rows stay
    # local): stage 0's holds the microbatches (every stage holds xs), each row replaced by the
    # microbatch's output of the last stage once stage 0 has read it. Its gradient (stage 0's
    # slice; the others' rows are never read) leaves the loop per stage, so the broadcast's
    # transpose sums it over the stages as the split over them wants (a reduce-scatter)
    io = _per_stage(jnp.broadcast_to(xs, (stages, *xs.shape)))
    io, aux_sum = loop.run(stage_params, io, segs, poss)
    y = stage_zero(stages, io) if packed else jnp.sum(jnp.where(loop.first[:, None], io, 0),
                                                       axis=0)
    return y.swapaxes(0, 1).reshape(x.shape), aux_sum


class _Loop:
    """The schedule's loop over iterations, with a backward of its own (custom VJP) that runs
    each iteration's re-run of its slots one iteration ahead.

    Iteration t, stage p works on virtual microbatch i = t - p (microbatch i mod M, pass i
    div M); every stage's pass is one `vmap` over the stage dim. The forward saves each
    iteration's stage inputs (as `pack` packs them) and nothing else. The backward walks the
    iterations in reverse. With `ahead` (remat full: each block's vjp re-runs it whole,
    model/block.RERUNS_WHOLE_BLOCK), backward iteration t runs each slot's vjp (its block's
    re-run, then its gradient) from slot inputs it already has and, beside it, iteration
    t - 1's slots but the last forward from that iteration's saved input, which gives the next
    backward iteration its slot inputs. The two share no data, so XLA's scheduler can run one's
    collectives (the MoE exchanges) under the other's compute, another microbatch's work
    under each exchange; differentiating a rematerialised loop body instead re-runs iteration
    t's slots and then differentiates them, one chain. The compute is the same (the slots but
    the last run once more per iteration, metrics.flops.pipelined_reruns; plus one pass's
    slots in the last backward iteration, whose result no iteration reads: 1 / (V M + P - 1)
    of them), and one microbatch's slot inputs are carried from one iteration to the next.
    Without `ahead` (the other policies) a backward iteration runs one vjp of its stage's
    whole pass from its saved input (the slots run forward once, keeping what the block's
    policy saves through the backward).

    The gradients of the stage params accumulate in the loop's carry, on a compute copy
    constrained every iteration to its stage layout (`_gradient_specs`). The aux values'
    cotangents: the summed keys' flow back; MAXED and ROOT_MEAN_SQUARE keys (dispatch_rounds,
    activation_rms: metrics, in no loss) get none."""

    def __init__(self, graphdef, mask: np.ndarray, dtype, packed: bool, run_layers,
                 schedule: PipelineSchedule, pins: list | None, ahead: bool):
        self.graphdef, self.mask, self.dtype = graphdef, mask, dtype  # mask [P, V, slots]
        self.packed, self.run_layers, self.schedule, self.pins = packed, run_layers, schedule, pins
        self.padded, self.slots = not mask.all(), mask.shape[-1]
        self.ahead = self.slots - 1 if ahead else 0
        stage_axes = mesh_axes("stage")
        self.spmd = stage_axes[0] if len(stage_axes) == 1 else (stage_axes or None)
        self.first = (jnp.arange(schedule.stages) == 0).reshape(schedule.stages, 1, 1, 1)
        # the backward traces when the step's backward is built, after run_pipeline returned:
        # it runs in the context (mesh, rules, within_stages, compute copy, replicas) of now
        self.context = contextvars.copy_context()
        self.spmd_names = jax_core.get_axis_env().spmd_axis_names
        self.run = jax.custom_vjp(self._forward)
        self.run.defvjp(self._fwd, self._bwd)

    # -- one stage's work (vmapped over the stages) --------------------------------------

    def _slots(self, stage_chunks, stage_mask, v, lo: int, hi: int):
        """Slots lo..hi-1 of the stage's pass v: (params [hi-lo, ...], mask or None)."""
        params = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, v, 0, keepdims=False)[lo:hi],
                              stage_chunks)
        keep = jax.lax.dynamic_index_in_dim(stage_mask, v, 0, keepdims=False)[lo:hi]
        return params, keep if self.padded else None

    def _input(self, h):
        return unpack(h, self.dtype) if self.packed else h

    def _saved(self, h):
        return pack(h, self.dtype) if self.packed else h

    def _stage(self, stage_chunks, stage_mask, h, seg, pos, v):
        """One stage's pass v over all its slots -> (h, aux [slots, ...])."""
        params, keep = self._slots(stage_chunks, stage_mask, v, 0, self.slots)
        return self.run_layers(self.graphdef, params, self._input(h), seg, pos, mask=keep)

    def _ahead(self, stage_chunks, stage_mask, h, seg, pos, v):
        """The inputs of the stage's slots 1 .. `ahead` [ahead, ...], as `_saved` keeps them."""
        h, ins = self._input(h), []
        for k in range(self.ahead):
            params, keep = self._slots(stage_chunks, stage_mask, v, k, k + 1)
            h = self.run_layers(self.graphdef, params, h, seg, pos, mask=keep)[0]
            ins.append(self._saved(h))
        return jnp.stack(ins)

    def _stage_vjp(self, stage_chunks, stage_mask, h, ins, ct_h, ct_aux, seg, pos, v, acc):
        """The stage's backward of pass v from its input h and slot inputs `ins`: -> (acc
        with the params' cotangent added at pass v, the input's cotangent)."""
        inputs = [self._input(h)] + [self._input(ins[k]) for k in range(self.ahead)]
        segments = [(k, k + 1) for k in range(self.ahead)] + [(self.ahead, self.slots)]
        cts = []
        for k, (lo, hi) in reversed(list(enumerate(segments))):
            params, keep = self._slots(stage_chunks, stage_mask, v, lo, hi)
            floats, rest, tree = _split_floats(params)

            def slot(floats, h, rest=rest, tree=tree, keep=keep):
                h, aux = self.run_layers(self.graphdef, _join_floats(floats, rest, tree), h,
                                         seg, pos, mask=keep)
                # only the aux values with a cotangent are outputs: a zero cotangent passed
                # in would still multiply each op's derivative (activation_rms' sqrt at 0,
                # in an idle iteration: 0 x inf)
                return h, {key: aux[key] for key in ct_aux}
            (_, aux), vjp = jax.vjp(slot, floats, inputs[k])
            ct_floats, ct_h = vjp((ct_h, {key: ct_aux[key][lo:hi].astype(a.dtype)
                                          for key, a in aux.items()}))
            cts.append(ct_floats)
        ct_pass = [jnp.concatenate(parts[::-1]) for parts in zip(*cts, strict=True)]
        acc = [jax.lax.dynamic_update_index_in_dim(
            a, jax.lax.dynamic_index_in_dim(a, v, 0, keepdims=False) + c.astype(a.dtype), v, 0)
            for a, c in zip(acc, ct_pass, strict=True)]
        return acc, ct_h

    def _vmapped(self, fn):
        return jax.vmap(fn, spmd_axis_name=self.spmd)

    # -- the loop ------------------------------------------------------------------------

    def _at(self, t):
        """Iteration t -> (valid [P], microbatch [P], pass [P]) of each stage."""
        s, m = self.schedule, self.schedule.microbatches
        i = t - jnp.arange(s.stages)
        valid = (i >= 0) & (i < s.repeats * m)
        clipped = jnp.clip(i, 0, s.repeats * m - 1)
        return valid, clipped % m, clipped // m

    def _loop(self, stage_params, io, segs, poss, save: bool):
        """The forward: -> ((io, aux_sum), each iteration's stage inputs as `_saved` keeps
        them [T, P, ...] where `save`, else None)."""
        s, m = self.schedule, self.schedule.microbatches
        stages, repeats = s.stages, s.repeats
        mask = jnp.asarray(self.mask)
        all_stages = self._vmapped(self._stage)
        buf = _ring(jnp.zeros((stages, *io.shape[2:]), io.dtype))  # the ring buffer
        aux_sum = _aux_zeros(all_stages, stage_params, mask, self._saved(buf), segs, poss,
                             repeats)

        def iteration(carry, t):
            buf, io, aux_sum = carry
            valid, micro, v = self._at(t)
            # stage 0 takes row t mod M: the microbatch itself on its first pass (t < M),
            # else its output of the last stage's previous pass, written at iteration
            # t - M + P - 1 (M >= P)
            h_in = self._saved(jnp.where(
                self.first, jax.lax.dynamic_index_in_dim(io, t % m, 1, keepdims=False), buf))
            h, aux = all_stages(stage_params, mask, h_in, segs[micro], poss[micro], v)
            weight = jax.nn.one_hot(v, repeats) * valid[:, None]  # [P, V]
            aux_sum = {k: _aux_add(k, acc, weight, aux[k]) for k, acc in aux_sum.items()}
            buf = _ring(jnp.roll(h, 1, axis=0))
            # buf[0] now holds the last stage's output of virtual microbatch t - P + 1: stage
            # 0 keeps it in io[0, its row mod M], read at iteration t - P + 1 (each stage
            # writes its own slice alike, unused). Before iteration P - 1 that is row 0, read
            # at t = 0 and written for real at P - 1, before stage 0 reads it again (t = M >= P)
            io = jax.lax.dynamic_update_index_in_dim(io, buf, self._row(t), 1)
            return (buf, io, aux_sum), h_in if save else None

        (_, io, aux_sum), saved = jax.lax.scan(iteration, (buf, io, aux_sum),
                                               jnp.arange(s.iterations))
        return (io, aux_sum), saved

    def _row(self, t):
        return jnp.maximum(t - self.schedule.stages + 1, 0) % self.schedule.microbatches

    def _forward(self, stage_params, io, segs, poss):
        return self._loop(stage_params, io, segs, poss, save=False)[0]

    def _fwd(self, stage_params, io, segs, poss):
        out, saved = self._loop(stage_params, io, segs, poss, save=True)
        return out, (stage_params, saved, segs, poss)

    def _bwd(self, res, cts):
        # and with the spmd axis names of the vmaps around the forward (replicas.on_replicas'):
        # jax (0.10, 0.12) traces a custom VJP's batched backward without them, and a
        # shard_map linearized there then gives its residuals specs over those axes, which
        # the vmap refuses ("vmap spmd_axis_name cannot appear in shard_map out_specs")
        missing = self.spmd_names - jax_core.get_axis_env().spmd_axis_names
        with jax_core.add_spmd_axis_names(tuple(missing)):
            return self.context.copy().run(self._backward, res, cts)

    def _backward(self, res, cts):
        stage_params, saved, segs, poss = res
        ct_io, ct_aux_sum = cts
        s, m = self.schedule, self.schedule.microbatches
        mask = jnp.asarray(self.mask)
        floats, rest, tree = _split_floats(stage_params)
        summed = {k: c for k, c in ct_aux_sum.items() if k not in MAXED + ROOT_MEAN_SQUARE}

        def pinned(acc):
            if self.pins is None:
                return acc
            return [jax.lax.with_sharding_constraint(a, sp)
                    for a, sp in zip(acc, self.pins, strict=True)]
        all_vjp = self._vmapped(self._stage_vjp)
        all_ahead = self._vmapped(self._ahead) if self.ahead else None

        def ahead(t):
            if all_ahead is None:
                return jnp.zeros((s.stages, 0), saved.dtype)
            _, micro, v = self._at(t)
            with jax.named_scope(AHEAD_SCOPE):  # plan/sites.py labels its collectives
                return all_ahead(stage_params, mask, saved[t], segs[micro], poss[micro], v)

        def iteration(carry, t):
            ct_buf, ct_io, acc, ins = carry
            row = self._row(t)  # the io update's transpose
            ct_buf = ct_buf + jax.lax.dynamic_index_in_dim(ct_io, row, 1, keepdims=False)
            ct_io = jax.lax.dynamic_update_index_in_dim(ct_io, jnp.zeros_like(ct_buf), row, 1)
            ct_h = _ring(jnp.roll(ct_buf, -1, axis=0))
            valid, micro, v = self._at(t)
            weight = jax.nn.one_hot(v, s.repeats) * valid[:, None]
            ct_aux = {k: jnp.einsum("pv,pv...->p...", weight, c) for k, c in summed.items()}
            acc, ct_in = all_vjp(stage_params, mask, saved[t], ins, ct_h, ct_aux, segs[micro],
                                 poss[micro], v, acc)
            # the input's transpose: stage 0 read io's row t mod M, the others the ring
            ct_row = jax.lax.dynamic_index_in_dim(ct_io, t % m, 1, keepdims=False)
            ct_io = jax.lax.dynamic_update_index_in_dim(
                ct_io, ct_row + jnp.where(self.first, ct_in, 0), t % m, 1)
            ct_buf = _ring(jnp.where(self.first, jnp.zeros((), ct_in.dtype), ct_in))
            return (ct_buf, ct_io, pinned(acc), ahead(jnp.maximum(t - 1, 0))), None

        last = s.iterations - 1
        zeros = pinned([jnp.zeros_like(a) for a in floats])
        carry = (_ring(jnp.zeros((s.stages, *ct_io.shape[2:]), ct_io.dtype)), _per_stage(ct_io),
                 zeros, ahead(last))
        (_, ct_io, acc, _), _ = jax.lax.scan(iteration, carry, jnp.arange(s.iterations),
                                             reverse=True)
        ct_params = _join_floats(acc, [None if r is None else _float0(r) for r in rest], tree)
        return ct_params, ct_io, _float0(segs), _float0(poss)


def _split_floats(tree):
    """A tree of nnx Variables -> (the float arrays, the other arrays with None in the
    floats' places, the treedef of the arrays)."""
    leaves, treedef = jax.tree.flatten(tree)
    floats = [a for a in leaves if jnp.issubdtype(a.dtype, jnp.inexact)]
    rest = [None if jnp.issubdtype(a.dtype, jnp.inexact) else a for a in leaves]
    return floats, rest, treedef


def _join_floats(floats, rest, treedef):
    it = iter(floats)
    return treedef.unflatten([next(it) if r is None else r for r in rest])


def _float0(a):
    return np.zeros(a.shape, jax.dtypes.float0)


def _ring(a: jax.Array) -> jax.Array:
    """[P, rows, S, D]: one microbatch's activation per stage, on the stage's devices."""
    return shard(a, ("stage", "batch", "seq", "act_embed"))


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
