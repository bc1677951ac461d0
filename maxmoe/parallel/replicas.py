"""A layer stack run on one weight replica per data-parallel device group (mesh.weights zero1
and hsdp): why the layer scans reduce no weight gradient over those axes.

On a compute copy replicated over the data-parallel axes, every layer reads the same weights
on every device while the rows are split over those axes, so each layer's weight gradient is
a partial sum per device: XLA all-reduces it inside the layer scan, at every layer and
microbatch, and the MoE shard_map's transpose psums the routed experts' there too. Instead the
copy holds one replica of each stacked param per group of those axes ([G, L, ...], split over
them: train/gradients.py ComputeCopy, sharding.copy_groups), and the stack runs under jax.vmap
over the replicas with spmd_axis_name, as the pipeline's vmap over stages: group g runs its own
rows on its own replica, so that replica's gradient is summed over the group's rows alone. The
replicas' gradients are added once per step, after the accumulation loop.

The weights replicated over the expert axis too (all stacked params but the routed experts')
would still be reduced over it per layer: the layer cannot run vmapped over that axis, as the
MoE's shard_map sends tokens over it. So the copy holds one replica of those per expert group
as well ([G, L, Ge, ...]: train/gradients.py sublayer_replicas), and inside each layer the
sublayers that read them (norms, attention, router, shared experts) run vmapped over those
replicas, each expert group on its own rows (`on_sublayer_replicas`), the routed experts'
shard_map between them on every group's tokens.

A stack the pipeline does not run (a dense prefix: model/spec.pipelined_path) sees its rows
split over the stage axes as over data, so the copy holds its replicas over those too
([G', L, ...], G' over the leading batch axes among the copy's groups, the stage axes, and for
a stack without routed experts the expert axes: ComputeCopy.unpiped), and `stack_replicas`
gives run_stack those axes for it: no row group all-reduces its gradients over the stages.

The params the outer part reads inside its row-group scan (model.outer_microbatches: the LM
head and the final norms, parallel/row_groups.py) are replicated over every axis that splits
the outer rows, so their gradients were all-reduced over all of them once per row group. The
copy holds one replica of those per group of those axes too ([G, ...]: ComputeCopy.outer),
and the head's loss runs vmapped over them (`on_outer_replicas`), each group on its rows.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from maxmoe.parallel.row_groups import combine_stacked, kept_aux
from maxmoe.sharding import (
    current_mesh,
    param_axes,
    replica_axes,
    shard,
    stack_source_spec,
    within_replicas,
)


def on_replicas(run, state, x, segment_ids, positions, axes: tuple[str, ...]):
    """run(state, x, segment_ids, positions) -> (x, aux [L, ...]) (a layer scan, or the
    pipeline) run once per replica of the stacked params in `state`, each on its own rows.

    state: a stack's variables, its params the compute copy's replicas [G, L, ...] (G groups
    of mesh `axes`, sharding.replica_axes), its buffers (e.g. the router bias) [L, ...], read
    alike by every group; x, segment_ids, positions [B, ...] split over the batch axes, `axes`
    major among them. Returns (x [B, ...], aux combined over the groups as over row groups:
    row_groups.combine_stacked of kept_aux, per-token entries dropped)."""
    g = next(v.get_value().shape[0] for v in jax.tree.leaves(
        state, is_leaf=lambda v: isinstance(v, nnx.Variable)) if isinstance(v, nnx.Param))

    def replicas(var):  # the params are the copy's replicas; a buffer is read by every group
        if isinstance(var, nnx.Param):
            return var
        return var.replace(jnp.broadcast_to(var.get_value(), (g, *var.get_value().shape)))

    def groups(a):  # [B, ...] -> [G, B/G, ...]: each group its block of rows, where it lies
        return a.reshape(g, a.shape[0] // g, *a.shape[1:])

    def one(replica, h, seg, pos):
        h, aux = run(replica, h, seg, pos)
        return h, kept_aux(aux)

    state = jax.tree.map(replicas, state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    with within_replicas(axes):
        y, aux = jax.vmap(one, spmd_axis_name=axes if len(axes) > 1 else axes[0])(
            state, groups(x), groups(segment_ids), groups(positions))
    return shard(y.reshape(x.shape), ("batch", "seq", "act_embed")), combine_stacked(aux)


def on_sublayer_replicas(fn, module, *rows):
    """fn(module, *rows) -> (outputs [B/G, ...] tree, aux dict or None), run once per replica
    of the module's non-expert params where the compute copy holds them per expert-axis group
    ([Ge, ...] in a layer: sharding.replica_axes(sublayers=True)), each group on its block of
    rows, vmapped over the expert axes; the routed experts' params (and the buffers) are read
    alike by every group, so the MoE's shard_map stays outside. Why: so attention, norms,
    router and shared experts reduce no weight gradient over the expert axis per layer.
    Elsewhere fn itself. Returns (outputs [B, ...], aux combined over the groups, per-token
    entries dropped)."""
    axes = replica_axes(sublayers=True)
    if not axes:
        return fn(module, *rows)
    graphdef, state = nnx.split(module)
    grouped = jax.tree.map(lambda v: 0 if isinstance(v, nnx.Param) and "experts" not in
                           param_axes(v) else None, state,
                           is_leaf=lambda v: isinstance(v, nnx.Variable))
    g = math.prod(current_mesh().shape[a] for a in axes)

    def one(state, *rows):
        out, aux = fn(nnx.merge(graphdef, state), *rows)
        return out, None if aux is None else kept_aux(aux)

    with within_replicas(axes):
        out, aux = jax.vmap(one, in_axes=(grouped, *(0,) * len(rows)),
                            spmd_axis_name=axes if len(axes) > 1 else axes[0])(
            state, *(a.reshape(g, a.shape[0] // g, *a.shape[1:]) for a in rows))
    out = jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), out)
    return out, None if aux is None else combine_stacked(aux)


def stack_axes(var, lead: int) -> tuple:
    """sharding.param_axes of a stacked param with `lead` stack dims ([L, ...] or the
    pipeline's [P, V, S, ...]), the compute copy's expert-group replica dim after them, if any
    ([..., Ge, ...] within a stack's replicas: on_sublayer_replicas), named "experts" so that
    it stays split over the expert axis, as the routed experts are."""
    logical = param_axes(var)
    if _group_dim(var, lead):
        return (*logical[:lead], "experts", *logical[lead + 1:])
    return logical


def _group_dim(var, lead: int) -> bool:
    """Whether a stacked param with `lead` stack dims carries the compute copy's expert-group
    replica dim after them (not a routed expert's own "experts" dim, which its axes name)."""
    own = len(var.get_metadata().get("axes", ()))
    return var.get_value().ndim - own == lead + 1 and bool(replica_axes(sublayers=True))


def stack_source(var) -> P:
    """sharding.stack_source_spec of a stacked param [L, ...] (the pipeline regroups it from
    there); of one with the expert-group replica dim [L, Ge, ...] (stack_axes), one replica's
    spec with that dim inserted, split over the groups' axes."""
    if not _group_dim(var, 1):
        return stack_source_spec(var)
    one = tuple(stack_source_spec(var.replace(var.get_value()[:, 0])))
    return P(*(*one, None)[:1], replica_axes(sublayers=True), *one[1:])


# the mesh axes the compute copy holds the outer params' replicas over, and those of the
# stacks the pipeline does not run, (without routed experts, with), () where they are the
# pipelined stacks' (replica_axes): set by copy_replicas
_OUTER: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("outer", default=())
_UNPIPED: contextvars.ContextVar[tuple] = contextvars.ContextVar("unpiped", default=((), ()))


@contextlib.contextmanager
def copy_replicas(outer: tuple[str, ...], unpiped: tuple[tuple[str, ...], tuple[str, ...]]):
    """While the step traces on a compute copy whose outer params (ComputeCopy.outer) hold one
    replica per group of mesh axes `outer` ([G, ...]; on_outer_replicas runs over them) and
    whose stacks outside the pipeline hold theirs over `unpiped` (dense, moe) (ComputeCopy
    .unpiped; run_stack runs such a stack over them, stack_replicas)."""
    t1 = _OUTER.set(tuple(outer))
    t2 = _UNPIPED.set(tuple(tuple(a) for a in unpiped))
    try:
        yield
    finally:
        _UNPIPED.reset(t2)
        _OUTER.reset(t1)


def on_outer_replicas(fn, params, *rows):
    """fn(params, *rows) -> a pytree of sums over rows, run once per replica of `params` where
    the copy holds the outer params' replicas (copy_replicas: each leaf [G, ...]), each group
    on its block of rows [B/G, ...] (the outer axes lead the batch split, so the blocks lie
    where they are), vmapped with spmd_axis_name: each replica's gradient is then summed over
    its group's rows alone, and the replicas' are added once per step (ComputeCopy.write),
    not all-reduced once per row group. Elsewhere fn itself. Returns the sums over groups."""
    axes = _OUTER.get()
    if not axes:
        return fn(params, *rows)
    g = math.prod(current_mesh().shape[a] for a in axes)
    with within_replicas(axes):
        out = jax.vmap(fn, spmd_axis_name=axes if len(axes) > 1 else axes[0])(
            params, *(a.reshape(g, a.shape[0] // g, *a.shape[1:]) for a in rows))
    return jax.tree.map(lambda a: jnp.sum(a, axis=0), out)


def stack_replicas(state, pipelined: bool) -> tuple[str, ...]:
    """The mesh axes a stack (its nnx.State `state`) runs over its replicas on (on_replicas),
    () for none: a pipelined one over sharding.replica_axes(); one outside the pipeline over
    copy_replicas' axes for its kind where set (they span the stage axes that split its
    rows there), else the same. () inside another vmap over replicas, off a compute copy."""
    axes = replica_axes()
    if pipelined or not axes:
        return axes
    experts = any(isinstance(v, nnx.Param) and "experts" in param_axes(v) for v in jax.tree.leaves(
        state, is_leaf=lambda v: isinstance(v, nnx.Variable)))
    return _UNPIPED.get()[experts] or axes