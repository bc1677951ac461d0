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
blocks; circular needs chunk order (v, p), so each step regroups them (`stage_layout`:
collective permutes that send each chunk once, like an FSDP gather in bytes). Only the stage
dim of the weights is constrained: their other dims keep their expert / fsdp / tensor split. The MoE aux values are summed (expert load) or averaged
over microbatches, which gives exactly the whole batch's: the balance losses are built from
them after the pipeline (model/router.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxmoe.model.spec import PipelineSchedule
from maxmoe.sharding import current_mesh, mesh_axes, param_axes, shard, spec

# aux values summed over microbatches (then averaged, expert_load kept a sum); other per-token
# outputs are dropped. Each is a sum or a mean over equal groups of rows (model/router.py), so
# the results equal the whole batch's.
_AUX_KEYS = ("z_loss", "sequence_balance_loss", "expert_load", "router_affinity",
             "activation_rms", "dropped_fraction")


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


def chunk_permutes(stages: int, repeats: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """The collective permutes that move natural-order layer blocks to stage order.

    Stored, stage q holds chunks q V + u (u < V) of a stack in natural order; circular stage p
    needs chunks v P + p (v < V). Returns (u, v, [(q, p), ...]) for every (u, v) that moves
    a chunk: chunk q V + u of q becomes pass v on p = q V + u - v P. Each (u, v) pairs distinct
    sources with distinct destinations (a partial permutation), and every (p, v) receives once.
    """
    out = []
    for v in range(repeats):
        for u in range(repeats):
            pairs = [(q, q * repeats + u - v * stages) for q in range(stages)
                     if 0 <= q * repeats + u - v * stages < stages]
            if pairs:
                out.append((u, v, pairs))
    return out


def _stage_order(a: jax.Array, logical: tuple, stages: int, repeats: int) -> jax.Array:
    """[L, ...] in natural layer order -> [L, ...] in stage order: rows p L/P ... (p+1) L/P - 1
    hold stage p's chunks v P + p, v = 0..V-1, in pass order.

    With the layer dim split over the stage axes (contiguous blocks, as stored) the chunks move
    with `chunk_permutes` inside a shard_map, each chunk sent once; XLA's partitioner, asked for
    the same regrouping as a reshape and transpose, replicated the whole stack on every device
    first. A layer dim that is whole on every stage is regrouped locally."""
    if repeats == 1:
        return a
    layers = a.shape[0]
    chunk = layers // (stages * repeats)
    stage_axes = mesh_axes("stage")
    pspec = spec(logical, shape=a.shape) if current_mesh() is not None else None
    lead = pspec[0] if pspec is not None and len(pspec) else None
    if not stage_axes or lead not in (stage_axes, stage_axes[0] if len(stage_axes) == 1 else None):
        a = a.reshape(repeats, stages, chunk, *a.shape[1:]).swapaxes(0, 1)
        return a.reshape(layers, *a.shape[3:])
    axis = stage_axes[0] if len(stage_axes) == 1 else stage_axes

    def regroup(local):  # [V Lc, ...]: this stage's stored chunks q V + u
        passes = []
        for v in range(repeats):
            got = None
            for u, w, pairs in chunk_permutes(stages, repeats):
                if w == v:
                    moved = jax.lax.ppermute(local[u * chunk:(u + 1) * chunk], axis, pairs)
                    got = moved if got is None else got + moved
            passes.append(got)
        return jnp.concatenate(passes, axis=0)

    # check_vma off as in parallel/experts.py (the pipeline's vmap confuses its inference)
    return jax.shard_map(regroup, in_specs=pspec, out_specs=pspec, check_vma=False)(a)


def stage_layout(state, stages: int, repeats: int):
    """Stacked layer params [L, ...] (natural order, as stored) -> [P, V, Lc, ...]: stage p,
    pass v holds chunk v P + p. The trailing dims keep their own sharding (expert, fsdp,
    tensor): only the stage dim is constrained, so no weight is gathered whole."""
    def one(var):
        a, logical = var.get_value(), param_axes(var)
        a = _stage_order(a, logical, stages, repeats)
        a = a.reshape(stages, repeats, a.shape[0] // (stages * repeats), *a.shape[1:])
        return var.replace(_constrain(a, ("stage", None, None, *logical[1:])))
    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def run_pipeline(stack, x, segment_ids, positions, *, run_layers, schedule: PipelineSchedule):
    """x [B, S, D] through all layers of `stack` (leading dim L) on the pipeline, as
    `schedule` (its stages = this mesh's; schedule.pipelines(L)) says.

    run_layers(graphdef, layer_state, h, segment_ids, positions) -> (h, aux stacked per layer)
    runs a chunk of layers (scan + remat as configured). Returns (x, aux [L, ...]).
    """
    stages, repeats, m = schedule.stages, schedule.repeats, schedule.microbatches
    graphdef, state = nnx.split(stack)
    layers = jax.tree.leaves(state)[0].shape[0]
    b = x.shape[0]

    stage_params = stage_layout(state, stages, repeats)  # [P, V, Lc, ...]

    def split(a):  # [B, ...] -> [M, B/M, ...]; microbatch j takes rows j, j + M, ...
        a = a.reshape(b // m, m, *a.shape[1:]).swapaxes(0, 1)
        return shard(a, (None, "batch") + (None,) * (a.ndim - 2))
    xs, segs, poss = split(x), split(segment_ids), split(positions)

    def stage_step(stage_chunks, h, seg, pos, v):
        """One stage: pick its chunk for pass v, run its layers."""
        params = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, v, 0, keepdims=False),
                              stage_chunks)
        return run_layers(graphdef, params, h, seg, pos)

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
