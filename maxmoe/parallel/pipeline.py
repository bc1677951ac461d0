"""Pipeline parallelism over the `stage` logical axis: GPipe and circular schedules.

A stack of L layers is cut into P stages x V repeats of Lc = L / (P V) layers; chunk
c = v P + p runs on stage p. All stages run at once as one `vmap` over the stage dimension,
mapped onto the pipeline mesh axis (`spmd_axis_name`), so XLA partitions it and every stage
keeps its own weights; between iterations the activations move one stage along the ring
(a collective permute). Iteration t, stage p works on virtual microbatch i = t - p:
microbatch i mod M on its pass i div M. The last stage's output feeds stage 0 on the next
iteration, which is exactly what the next pass of a circular schedule needs when M = P.

- gpipe (V = 1): any M; bubble (P - 1) / (M + P - 1).
- circular (V > 1, M = P): bubble (P - 1) / (V M + P - 1), V times smaller for the same M.
The schedule's arithmetic (P, V, M, bubble, which groups) is model/spec.py's PipelineSchedule.

Weights are stored in natural layer order, sharded over the pipeline axis in contiguous
blocks; circular needs chunk order (v, p), so each step regroups them (an all-to-all of the
pipelined weights, like an FSDP gather). Balance losses are averaged over microbatches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxmoe.model.spec import PipelineSchedule
from maxmoe.sharding import current_mesh, mesh_axes, shard

# aux values summed over microbatches (then averaged); other per-token outputs are dropped
# (dispatch_rounds: the mean over microbatches of each layer's rounds)
_AUX_KEYS = ("balance_loss", "z_loss", "sequence_balance_loss", "expert_load", "activation_rms",
             "dropped_fraction", "dispatch_rounds")


def num_stages() -> int:
    mesh = current_mesh()
    if mesh is None:
        return 1
    n = 1
    for axis in mesh_axes("stage"):
        n *= mesh.shape[axis]
    return n


def run_pipeline(stack, x, segment_ids, positions, *, run_layers, schedule: PipelineSchedule):
    """x [B, S, D] through all layers of `stack` (leading dim L) on the pipeline, as
    `schedule` (its stages = this mesh's; schedule.pipelines(L)) says.

    run_layers(graphdef, layer_state, h, segment_ids, positions) -> (h, aux stacked per layer)
    runs a chunk of layers (scan + remat as configured). Returns (x, aux [L, ...]).
    """
    stages, repeats, m = schedule.stages, schedule.repeats, schedule.microbatches
    graphdef, state = nnx.split(stack)
    layers = jax.tree.leaves(state)[0].shape[0]
    chunk = layers // (stages * repeats)
    b = x.shape[0]

    # [L, ...] -> [V, P, Lc, ...]: chunk c = v P + p; stage dim on the pipeline axis
    def to_chunks(a):
        a = a.reshape(repeats, stages, chunk, *a.shape[1:])
        return shard(a, (None, "stage") + (None,) * (a.ndim - 2))
    chunks = jax.tree.map(to_chunks, state)

    def split(a):  # [B, ...] -> [M, B/M, ...]; microbatch j takes rows j, j + M, ...
        a = a.reshape(b // m, m, *a.shape[1:]).swapaxes(0, 1)
        return shard(a, (None, "batch") + (None,) * (a.ndim - 2))
    xs, segs, poss = split(x), split(segment_ids), split(positions)

    def stage_step(stage_chunks, h, seg, pos, v):
        """One stage: pick its chunk for pass v, run its layers."""
        params = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, v, 0, keepdims=False),
                              stage_chunks)
        return run_layers(graphdef, params, h, seg, pos)

    stage_params = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), chunks)  # [P, V, Lc, ...]
    stage_axes = mesh_axes("stage")
    all_stages = jax.vmap(stage_step, spmd_axis_name=stage_axes[0] if len(stage_axes) == 1
                          else (stage_axes or None))

    stage_index = jnp.arange(stages)
    buf = shard(jnp.zeros((stages, *xs.shape[1:]), x.dtype), ("stage", "batch", "seq", "act_embed"))
    out = jnp.zeros_like(xs)
    aux_shapes = jax.eval_shape(lambda: all_stages(
        stage_params, buf, jnp.zeros((stages, *segs.shape[1:]), segs.dtype),
        jnp.zeros((stages, *poss.shape[1:]), poss.dtype), jnp.zeros((stages,), jnp.int32))[1])
    # per stage and pass: [P, V, Lc, ...]
    aux_sum = {k: jnp.zeros((stages, repeats, *s.shape[1:]), jnp.float32)
               for k, s in aux_shapes.items() if k in _AUX_KEYS}

    def iteration(carry, t):
        buf, out, aux_sum = carry
        i = t - stage_index  # virtual microbatch of each stage
        valid = (i >= 0) & (i < repeats * m)
        micro = jnp.clip(i, 0, repeats * m - 1) % m
        v = jnp.clip(i, 0, repeats * m - 1) // m
        # stage 0 takes a fresh microbatch on the first pass, else what the ring brought
        fresh = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, m - 1), 0, keepdims=False)
        h_in = buf.at[0].set(jnp.where(t < m, fresh, buf[0]))
        h, aux = all_stages(stage_params, h_in, segs[micro], poss[micro], v)
        weight = jax.nn.one_hot(v, repeats) * valid[:, None]  # [P, V]
        aux_sum = {k: acc + jnp.einsum("pv,p...->pv...", weight, aux[k].astype(jnp.float32))
                   for k, acc in aux_sum.items()}
        # the last stage finishing its final pass emits microbatch i - (V - 1) M
        last = i[stages - 1] - (repeats - 1) * m
        done = (last >= 0) & (last < m)
        out = jnp.where(done, jax.lax.dynamic_update_index_in_dim(
            out, h[stages - 1], jnp.clip(last, 0, m - 1), 0), out)
        buf = shard(jnp.roll(h, 1, axis=0), ("stage", "batch", "seq", "act_embed"))
        return (buf, out, aux_sum), None

    (_, out, aux_sum), _ = jax.lax.scan(iteration, (buf, out, aux_sum),
                                        jnp.arange(schedule.iterations))
    y = out.swapaxes(0, 1).reshape(x.shape)
    # aux [P, V, Lc, ...] summed over microbatches -> mean, in natural layer order [L, ...]
    aux = {k: (a / m).swapaxes(0, 1).reshape(layers, *a.shape[3:]) for k, a in aux_sum.items()}
    aux["expert_load"] = aux["expert_load"] * m if "expert_load" in aux else None  # a count
    aux = {k: a for k, a in aux.items() if a is not None}
    return shard(y, ("batch", "seq", "act_embed")), aux
