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
memory at scale"). The loop's backward is its own (parallel/pipeline_loop.Loop, a custom
VJP): under a block remat it re-runs each iteration's slots one backward iteration ahead,
beside another microbatch's backward, so each one's MoE exchanges can run under the other's
compute (docs/performance/gpu.md, "The re-run ahead").

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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxmoe.parallel.pipeline_loop import Loop, per_stage
from maxmoe.parallel.replicas import stack_axes
from maxmoe.parallel.row_groups import MAXED, ROOT_MEAN_SQUARE
from maxmoe.parallel.schedule import PipelineSchedule
from maxmoe.parallel.stage_weights import stage_layout
from maxmoe.parallel.stage_words import packs, stage_zero
from maxmoe.sharding import (
    current_mesh,
    mesh_axes,
    on_compute_copy,
    shard,
    spec,
    within_stages,
)


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
    loop = Loop(graphdef, np.asarray(table).reshape(stages, schedule.repeats, -1) >= 0,
                x.dtype, packed, run_layers, schedule, pins, ahead)
    xs, segs, poss = (_microbatches(a, schedule.microbatches) for a in (x, segment_ids, positions))
    # `io` [P, M, ...], each stage's slice on its own devices (reads at loop-varying rows stay
    # local): stage 0's holds the microbatches (every stage holds xs), each row replaced by the
    # microbatch's output of the last stage once stage 0 has read it. Its gradient (stage 0's
    # slice; the others' rows are never read) leaves the loop per stage, so the broadcast's
    # transpose sums it over the stages as the split over them wants (a reduce-scatter)
    io = per_stage(jnp.broadcast_to(xs, (stages, *xs.shape)))
    io, aux_sum = loop.run(stage_params, io, segs, poss)
    y = stage_zero(stages, io) if packed else jnp.sum(jnp.where(loop.first[:, None], io, 0),
                                                       axis=0)
    return y.swapaxes(0, 1).reshape(x.shape), aux_sum


def _microbatches(a: jax.Array, m: int) -> jax.Array:
    """[B, ...] split over the batch axes -> [M, B/M, ...]; microbatch j takes rows j, j + M,
    ... (first gathered over the stage axes, the last batch axes: the reshape stays local)."""
    a = shard(a, ("batch",) + (None,) * (a.ndim - 1))
    a = a.reshape(a.shape[0] // m, m, *a.shape[1:]).swapaxes(0, 1)
    return shard(a, (None, "batch") + (None,) * (a.ndim - 2))


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
