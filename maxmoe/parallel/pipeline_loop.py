"""The pipeline schedule's loop over iterations (parallel/pipeline.py builds and runs it), with a
backward of its own (a custom VJP) that re-runs each iteration's slots one backward iteration
ahead, and the per-iteration bookkeeping forward and backward share: the ring of activations
between stages, each stage's io buffer, the MoE aux values summed per stage and pass.
"""

from __future__ import annotations

import contextvars

import jax
import jax.numpy as jnp
import numpy as np

from maxmoe.parallel.row_groups import MAXED, ROOT_MEAN_SQUARE
from maxmoe.parallel.schedule import PipelineSchedule
from maxmoe.parallel.stage_words import pack, unpack
from maxmoe.parallel.vmap_axes import spmd_axis_names, with_spmd_axis_names
from maxmoe.sharding import mesh_axes, shard

# the named scope of the backward's re-run of a pass ahead (Loop)
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


class Loop:
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
    constrained every iteration to its stage layout (`pins`: pipeline._gradient_specs). The aux
    values' cotangents: the summed keys' flow back; MAXED and ROOT_MEAN_SQUARE keys
    (dispatch_rounds, activation_rms: metrics, in no loss) get none."""

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
        self.spmd_names = spmd_axis_names()
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
        buf = ring(jnp.zeros((stages, *io.shape[2:]), io.dtype))  # the ring buffer
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
            buf = ring(jnp.roll(h, 1, axis=0))
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
        # in the forward's context, with the spmd axis names of the vmaps around it
        # (replicas.on_replicas'), which jax drops here (parallel/vmap_axes.py says why)
        with with_spmd_axis_names(self.spmd_names):
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
            ct_h = ring(jnp.roll(ct_buf, -1, axis=0))
            valid, micro, v = self._at(t)
            weight = jax.nn.one_hot(v, s.repeats) * valid[:, None]
            ct_aux = {k: jnp.einsum("pv,pv...->p...", weight, c) for k, c in summed.items()}
            acc, ct_in = all_vjp(stage_params, mask, saved[t], ins, ct_h, ct_aux, segs[micro],
                                 poss[micro], v, acc)
            # the input's transpose: stage 0 read io's row t mod M, the others the ring
            ct_row = jax.lax.dynamic_index_in_dim(ct_io, t % m, 1, keepdims=False)
            ct_io = jax.lax.dynamic_update_index_in_dim(
                ct_io, ct_row + jnp.where(self.first, ct_in, 0), t % m, 1)
            ct_buf = ring(jnp.where(self.first, jnp.zeros((), ct_in.dtype), ct_in))
            return (ct_buf, ct_io, pinned(acc), ahead(jnp.maximum(t - 1, 0))), None

        last = s.iterations - 1
        zeros = pinned([jnp.zeros_like(a) for a in floats])
        carry = (ring(jnp.zeros((s.stages, *ct_io.shape[2:]), ct_io.dtype)), per_stage(ct_io),
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


def ring(a: jax.Array) -> jax.Array:
    """[P, rows, S, D]: one microbatch's activation per stage, on the stage's devices."""
    return shard(a, ("stage", "batch", "seq", "act_embed"))


def per_stage(a: jax.Array) -> jax.Array:
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
