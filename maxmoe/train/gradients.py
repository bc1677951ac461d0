"""The step's gradients: microbatch accumulation, and the compute copy of mesh.weights.

`make_gradients` returns (params, batch, buffers, scale_state) -> (grads, metrics) of the whole
batch over train.grad_accum_steps microbatches. Under mesh.weights zero1 / hsdp the
microbatches read a compute copy of the params (`ComputeCopy`, laid out by
`sharding.compute_axes`) made once per step, and their gradients are summed in that layout,
so the reduction over the data-parallel axes runs once per step rather than per microbatch.
The copy of the stacked (layer-scanned) params holds one replica per data-parallel device
group (sharding.copy_groups), which the stacks run vmapped over (parallel/replicas.py), so no
layer's gradient is reduced over those axes inside the scans either: the replicas' float32
sums are added once per step (`ComputeCopy.write`). So are those of the LM head and final
norms, held one replica per group of the batch axes (`outer_params`), so the outer part's
row-group scan reduces none of their gradients either.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from maxmoe.config import Config
from maxmoe.kernels.fp8 import BLOCK
from maxmoe.model.spec import layer_groups, pipelined_path
from maxmoe.model.transformer import DTYPES, LossShare, load_summary, loss_token_counts
from maxmoe.parallel.replicas import copy_replicas
from maxmoe.parallel.row_groups import combine_stacked
from maxmoe.sharding import (
    as_spec,
    compute_axes,
    compute_copy,
    copy_groups,
    param_axes,
    path_keys,
)
from maxmoe.train.precision import make_loss_scaler
from maxmoe.validation import dcn_sizes


@dataclasses.dataclass(frozen=True)
class ComputeCopy:
    """mesh.weights zero1 / hsdp: the params compute reads, made once per step from the
    float32 state (sharding.compute_axes), and where their gradients go back to."""
    weights: str
    dcn: dict  # mesh axis -> its DCN factor (hsdp keeps the others' storage split)
    # NamedSharding per param: the copy's layout (replicated over data, fsdp; a stacked
    # param's replicas split over them)
    shardings: Any
    dtypes: Any  # per param: the compute dtype, float32 where the model reads float32
    stored: Any  # NamedSharding per param: the train state's layout (ZeRO-3 over all axes)
    # per param: how many replicas of it the copy holds ([G, L, ...]), 0 for none: G for the
    # pipelined stacks, more for a stack outside the pipeline (unpiped)
    stacked: Any
    groups: tuple = ()  # the mesh axes (size > 1) of the replicas: sharding.copy_groups
    replicas: int = 1  # G: one replica per group of sharding.copy_groups' axes
    # the replica axes of the stacks outside the pipeline, (without routed experts, with):
    # the leading batch axes among groups and the stage axes (unpiped_groups); () for groups
    unpiped: tuple = ((), ())
    # per param: whether its stacked replicas hold one replica per expert-axis group too,
    # [G, L, Ge, ...] (all stacked params but the routed experts': sublayer_groups)
    sublayer: Any = None
    sublayer_groups: tuple = ()  # the expert axes of those replicas (size > 1)
    sublayer_replicas: int = 1  # Ge
    # per param: whether the copy holds one replica of it per group of outer_groups, [Go, ...]
    # (the params the LM loss reads inside the row-group scan: outer_params)
    outer: Any = None
    outer_groups: tuple = ()  # the batch axes of those replicas (size > 1): outer_params
    outer_replicas: int = 1  # Go

    def read(self, params):
        """The float32 params (state layout) -> the copy: cast, and each stacked param
        [L, ...] repeated G times, [G, L, ...], one replica per device group (the layer stacks
        run vmapped over them: parallel/replicas.py), laid out."""
        params = jax.tree.map(lambda p, t: p.astype(t), params, self.dtypes)
        params = jax.tree.map(lambda p, s, e: self._replicated(p, s) if s and e else
                              jnp.broadcast_to(p, (s, *p.shape)) if s else p,
                              params, self.stacked, self.sublayer)
        params = jax.tree.map(lambda p, o: jnp.broadcast_to(p, (self.outer_replicas, *p.shape))
                              if o else p, params, self.outer)
        return _constrained(params, self.shardings)

    def _replicated(self, p, g):  # [L, ...] -> [G, L, Ge, ...]
        return jnp.broadcast_to(p[None, :, None], (g, p.shape[0],
                                                   self.sublayer_replicas, *p.shape[1:]))

    def write(self, grads):
        """Gradients of the copy -> the state's layout, the replicas' gradients added: the one
        reduction over the replica axes of the stacked and outer params' gradients."""
        grads = jax.tree.map(lambda g, s, e, o: jnp.sum(g, axis=(0, 2)) if s and e else
                             jnp.sum(g, axis=0) if s or o else g, grads, self.stacked,
                             self.sublayer, self.outer)
        return _constrained(grads, self.stored)


def compute_copy_of(cfg: Config, mesh: Mesh | AbstractMesh, abstract_vars, stored):
    """The ComputeCopy of `cfg` (None under mesh.weights=zero3) for the params `abstract_vars`
    (an nnx.State of nnx.Params) stored at `stored`."""
    if cfg.mesh.weights == "zero3":
        return None
    dcn = dcn_sizes(cfg)
    copy = nnx.to_pure_dict(compute_shardings(cfg, mesh, abstract_vars, dcn))
    compute = DTYPES[cfg.precision.compute_dtype]
    dtypes = nnx.to_pure_dict(jax.tree.map(
        lambda v: v.replace(jnp.float32 if v.get_metadata().get("compute_float32") else compute),
        abstract_vars, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    groups = () if not fp8_tiles_in_rows(cfg) else tuple(
        a for a in copy_groups(cfg.mesh.rules, cfg.mesh.weights, dcn) if mesh.shape[a] > 1)
    replicas = math.prod(mesh.shape[a] for a in groups)
    kind = stack_kinds(cfg, mesh, abstract_vars) if replicas > 1 else jax.tree.map(
        lambda _: 0, copy)
    unpiped = unpiped_groups(cfg, mesh, copy, kind, groups)
    axes = {1: groups, 2: unpiped[0] or groups, 3: unpiped[1] or groups}
    stacked = jax.tree.map(lambda k: math.prod(mesh.shape[a] for a in axes[k]) if k else 0,
                           kind)
    sub, sub_groups = sublayer_replicas(cfg, mesh, abstract_vars, copy, stacked)
    # a stack whose replicas span the expert axes runs no sublayer vmap over them
    sub = jax.tree.map(lambda e, k: e and not set(sub_groups) & set(axes.get(k, ())), sub, kind)
    copy = jax.tree.map(  # [G, L, ...] over groups; [G, L, Ge, ...] over groups, L's, sub_groups
        lambda c, k, e: NamedSharding(mesh, P(axes[k], *((*c.spec, None)[:1], sub_groups)
                                               + tuple(c.spec[1:]) if e else c.spec))
        if k else c, copy, kind, sub)
    outer, outer_axes = outer_params(cfg, mesh, copy)  # the LM loss runs no FP8 GEMM
    copy = jax.tree.map(lambda c, o: NamedSharding(mesh, P(outer_axes, *(
        _without(e, outer_axes) for e in c.spec))) if o else c, copy, outer)
    return ComputeCopy(cfg.mesh.weights, dcn, copy, dtypes, stored, stacked, groups, replicas,
                       unpiped, sub, sub_groups, math.prod(mesh.shape[a] for a in sub_groups),
                       outer, outer_axes, math.prod(mesh.shape[a] for a in outer_axes))


def fp8_tiles_in_rows(cfg: Config) -> bool:
    """Whether the layers' FP8 GEMMs (precision.fp8) compute the same on replicas, each a
    group of whole batch rows, as on the whole batch: no FP8; or blockwise with
    data.seq_len a multiple of the 128-token tile, so every weight-gradient token tile
    (kernels/fp8.token_tiled_matmul) lies in one row, as on one device. Not tensorwise: its
    amax would span a group's rows, not the batch's."""
    fp8 = cfg.precision.fp8
    return fp8 == "none" or fp8 == "blockwise" and cfg.data.seq_len % BLOCK == 0


def _without(entry, axes) -> tuple:
    """A spec entry (None, an axis, a tuple of axes) as a tuple without `axes`."""
    return tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a not in axes)


# the params the LM loss reads inside the outer row-group scan (Transformer._lm_loss): the
# head, the final norm, and each MTP depth's final norm (mtp/<k>/final_norm)
OUTER = ("lm_head", "final_norm")


def outer_params(cfg: Config, mesh, copy):
    """(per param: whether the copy holds one replica of it per group of the outer axes, those
    axes): the LM head and final norms (OUTER), over the batch axes (size > 1) that split the
    outer rows and that no such param's copy is split over but the stage axes (compute_axes
    keeps those where storage puts them; these copies drop them, else each row group would
    reduce-scatter their gradients over the stages), the leading ones in the batch split (so
    each group's rows lie on its devices). Why: the LM loss runs vmapped over them
    (parallel/replicas.py on_outer_replicas), so no row group all-reduces their gradients.
    Off (all False, ()) where the groups would be 1."""
    def mine(path, _):
        keys = path_keys(path)
        return keys[0] in OUTER or keys[:1] == ("mtp",) and keys[2:3] == ("final_norm",)

    outer = jax.tree_util.tree_map_with_path(mine, copy)
    stages = set(cfg.mesh.rules.get("stage", []))  # where the copy keeps them, dropped
    used = {a for c, o in zip(jax.tree.leaves(copy), jax.tree.leaves(outer), strict=True)
            if o for e in c.spec for a in _without(e, stages)}
    axes = _leading_batch_axes(cfg, mesh, lambda a: a not in used)
    if not axes:
        return jax.tree.map(lambda _: False, outer), ()
    return outer, axes


def _leading_batch_axes(cfg: Config, mesh, ok) -> tuple[str, ...]:
    """The leading axes of the rules' batch split (size > 1) while ok(axis): a group of them
    holds a leading block of the batch's rows, as the vmaps over replicas need."""
    return tuple(itertools.takewhile(
        ok, (a for a in cfg.mesh.rules.get("batch", []) if mesh.shape[a] > 1)))


def stack_kinds(cfg: Config, mesh, abstract_vars):
    """Per param (a pure dict): 0 not stacked; 1 in a stack the pipeline runs (or no stage
    axes); 2 / 3 in a stack outside the pipeline without / with routed experts (a dense
    prefix / a MoE group too short to pipeline), whose rows the stage axes split."""
    stages = math.prod(mesh.shape[a] for a in cfg.mesh.rules.get("stage", []))
    staged, kinds = pipelined_path(cfg.model, stages), layer_groups(cfg.model)

    def one(path, v):
        keys = path_keys(path)
        if param_axes(v)[:1] != ("layers",):
            return v.replace(0)
        if stages == 1 or staged(path) or keys[:1] != ("layer_groups",):
            return v.replace(1)
        return v.replace(3 if kinds[keys[1]][0] else 2)

    return nnx.to_pure_dict(jax.tree_util.tree_map_with_path(
        one, abstract_vars, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def unpiped_groups(cfg: Config, mesh, copy, kind, groups: tuple) -> tuple:
    """(dense, moe): the mesh axes the copy holds the replicas of a stack outside the pipeline
    over (stack_kinds 2, 3), () where those would be `groups`: the leading batch axes (size
    > 1) among `groups`, the stage axes and, for a stack without routed experts, the expert
    axes, that no param of its kind's copy is split over. Why: outside the pipeline the stage
    axes split the rows as data does, so on `groups` alone each row group would all-reduce
    the stack's gradients over the stages; the expert axes come along where they lie
    between (the batch is split data, fsdp, expert, pipeline), as the replicas' rows must be
    a leading block of the batch split (replicas.on_replicas)."""
    stage, experts = cfg.mesh.rules.get("stage", []), cfg.mesh.rules.get("experts", [])
    out = []
    for k, extra in ((2, (*stage, *experts)), (3, stage)):
        used = {a for c, n in zip(jax.tree.leaves(copy), jax.tree.leaves(kind), strict=True)
                if n == k for e in c.spec for a in _without(e, ())}
        axes = _leading_batch_axes(
            cfg, mesh, lambda a, used=used, extra=extra: a not in used and a in (*groups, *extra))
        spans = set(groups) <= set(axes) and set(axes) & set(stage)
        out.append(tuple(axes) if spans else ())
    return tuple(out)


def compute_shardings(cfg: Config, mesh: Mesh | AbstractMesh, abstract_vars, dcn):
    """NamedSharding of every nnx.Variable's compute copy (sharding.compute_axes): staged (split
    over the stage axes where storage puts them) only the layer groups the pipeline runs;
    the rest (embedding, LM head, MTP, a dense prefix) run where the stage axes split their
    rows, so a copy split over them would be gathered at every outer row group."""
    staged = pipelined_path(cfg.model, math.prod(mesh.shape[a]
                                                 for a in cfg.mesh.rules.get("stage", [])))

    def one(path, v):
        axes = compute_axes(param_axes(v), cfg.mesh.rules, dict(mesh.shape),
                            v.get_value().shape, cfg.mesh.weights, dcn, staged(path))
        return v.replace(NamedSharding(mesh, as_spec(axes)))

    return jax.tree_util.tree_map_with_path(one, abstract_vars,
                                            is_leaf=lambda x: isinstance(x, nnx.Variable))


def sublayer_replicas(cfg: Config, mesh, abstract_vars, copy, stacked):
    """(per param: whether its stacked replicas get an expert-axis replica dim too, the expert
    axes of size > 1): every stacked param but the routed experts', so the sublayers that read
    them (attention, norms, router, shared experts) run vmapped over expert-axis groups of
    rows (parallel/replicas.py on_sublayer_replicas) and no gradient of theirs is reduced over
    the expert axis per layer. Off (all False) where a stacked copy already splits a dim over
    those axes, or the copy has no replicas."""
    axes = tuple(a for a in cfg.mesh.rules.get("experts", []) if mesh.shape[a] > 1
                 and a in cfg.mesh.rules.get("batch", []))
    mine = nnx.to_pure_dict(jax.tree.map(
        lambda v: v.replace(isinstance(v, nnx.Param) and "experts" not in param_axes(v)),
        abstract_vars, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    sub = jax.tree.map(lambda s, m: bool(s and m and axes), stacked, mine)
    used = {a for c, e in zip(jax.tree.leaves(copy), jax.tree.leaves(sub), strict=True) if e
            for ax in c.spec if ax for a in ((ax,) if isinstance(ax, str) else ax)}
    if used & set(axes) or not any(jax.tree.leaves(sub)):
        return jax.tree.map(lambda _: False, sub), ()
    return sub, axes


# microbatch metrics summed into the step's under gradient accumulation (accumulated)
SUMMED = ("loss", "ce_loss", "mtp_loss", "balance_loss", "z_loss", "sequence_balance_loss",
          "dropped_fraction", "expert_load")


def accumulated(metrics: dict) -> dict:
    """Metrics stacked over microbatches [A, ...] (each from the model's loss under a
    LossShare) -> the whole step's, the values one unsplit batch gives:

    - SUMMED: the loss terms and dropped_fraction, already weighted by the share (tokens for
      cross-entropies, 1 / A for position means), and expert_load, a count;
    - expert_load_max / _min, load_max_mean_ratio_max: recomputed from the summed load (a
      max of microbatch maxima would not be the step's);
    - ROOT_MEAN_SQUARE (row_groups): the residual RMS per layer, root of the mean square over
      microbatches (each holds the same number of positions);
    - MAXED (row_groups): dispatch_rounds, the rounds the worst microbatch needed;
    - anything else: the mean over microbatches (router_entropy and
      dropped_fraction_by_layer: exactly the step's, as every microbatch has as many tokens
      and assignments).

    row_groups.combine_stacked applies these rules."""
    out = combine_stacked(metrics, summed=SUMMED)
    if "expert_load" in out:
        out.update(load_summary(out["expert_load"]))
    return out


def make_gradients(cfg: Config, graphdef, micro_spec: P, copy: ComputeCopy | None = None):
    """(params, batch, buffers, scale_state) -> (grads, metrics) of the whole batch, computed
    over train.grad_accum_steps microbatches (a scan), the loss scaled under float16.

    Each microbatch's loss is weighted by its share of the step (LossShare: loss tokens for
    the cross-entropies), so the summed gradients equal the unsplit batch's; exactly so for
    every loss term but the Switch balance loss (moe.aux_loss_weight), a product of batch
    means, which becomes the mean of the microbatches' balance losses.

    With a ComputeCopy (mesh.weights zero1 / hsdp) the microbatches read `copy`'s params, made
    once, and add their gradients in float32 in the copy's layout: replicated over the data
    parallel axes, so each device sums its own rows' partial gradients and one reduction per
    step (all-reduce or reduce-scatter, in the compute dtype) brings them to the state's layout.
    XLA:GPU hoists that reduction out of the accumulation loop (its while-loop all-reduce code
    motion); XLA:CPU does not, so a CPU plan counts it once per microbatch. The stacked
    params' gradients, one per replica (ComputeCopy.read), are never reduced over the replica
    axes in the loop on either compiler: their replicas are added after it, in float32."""
    gradients = _gradients(cfg, graphdef, micro_spec, copy)
    if copy is None:
        return gradients

    def on_copy(params, batch, buffers, scale_state):
        with compute_copy(copy.weights, copy.dcn, copy.groups, copy.sublayer_groups), \
                copy_replicas(copy.outer_groups, copy.unpiped):
            grads, metrics = gradients(copy.read(params), batch, buffers, scale_state)
        return copy.write(grads), metrics

    return on_copy


def _constrained(tree, shardings):
    return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def _gradients(cfg: Config, graphdef, micro_spec: P, copy: ComputeCopy | None):
    """make_gradients' accumulation; under a ComputeCopy the float32 sums stay in its layout."""
    accum = cfg.train.grad_accum_steps
    scaler = make_loss_scaler(cfg.precision)

    def in_layout(grads):  # float32 sums, kept in the copy's layout (no reduction inside)
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return grads if copy is None else _constrained(grads, copy.shardings)

    def loss_fn(params, batch, buffers, scale_state, share=None):
        loss, metrics = nnx.merge(graphdef, params, *buffers).loss(batch, share)
        if scaler is not None:  # float16: scale so small gradients survive the backward pass
            loss = scaler.scale(loss, scale_state)
        return loss, metrics

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def gradients(params, batch, buffers, scale_state):
        if accum == 1:
            (_, metrics), grads = grad_fn(params, batch, buffers, scale_state)
            return in_layout(grads), metrics

        def split(x):  # [B, ...] -> [A, B/A, ...]; microbatch j takes rows j, j+A, ...
            x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
            return jax.lax.with_sharding_constraint(x, P(*micro_spec[: x.ndim]))

        share = LossShare(loss_token_counts(batch, cfg.model.mtp_depth), accum)

        def body(acc, micro):
            # the copy pinned inside the loop too: else XLA may carry the stored layout in
            # and gather at every microbatch
            read = params if copy is None else _constrained(params, copy.shardings)
            (_, metrics), grads = grad_fn(read, micro, buffers, scale_state, share)
            return in_layout(jax.tree.map(jnp.add, in_layout(acc), in_layout(grads))), metrics

        zeros = in_layout(jax.tree.map(jnp.zeros_like, params))
        grads, metrics = jax.lax.scan(body, zeros, jax.tree.map(split, batch))
        grads = in_layout(grads)  # the loop's result too: else XLA shards its carry
        return grads, accumulated(metrics)

    return gradients


