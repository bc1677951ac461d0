"""Analytic train-state bytes per device: no devices, no mesh object, no compile.

`state_bytes(cfg, sizes)` sizes every leaf of the train state from its shape, dtype and the
mesh axes it is stored over (`sharding.state_dim_axes`, the choice `make_trainer`'s
shardings make), for mesh axis sizes of any cluster: `maxmoe plan --search` ranks layouts by
it before compiling any, and the launch-template test checks that the templates fit.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from maxmoe.config import Config, stage_local_rules
from maxmoe.model.router import RouterBias
from maxmoe.model.spec import pipelined_path
from maxmoe.model.transformer import build_model
from maxmoe.sharding import compute_axes, dim_axes, param_axes, variable_axes
from maxmoe.train.optimizer import make_optimizer


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One train-state leaf on one device: `path` as jax.tree_util.keystr under its part."""
    path: str
    shape: tuple[int, ...]  # per device
    dtype: Any
    sharded: bool  # split over every mesh axis of size > 1 (a scalar counts as sharded)
    gathered_over: tuple[str, ...] = ()  # axes compute all-gathers it over (stored, not rules)
    copy_elements: int = 0  # per device in mesh.weights=zero1's compute copy (compute_axes)

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes per device of the train state's parts (the scalar step/guard/loss-scale entries,
    a few hundred bytes, are left out). `grads` are the step's gradients: float32 like the
    master params they are taken against, sharded as the params. `total` = params + opt_state
    + buffers (optimizer.offload_state keeps opt_state in host memory; it is counted anyway).
    `replicated`: (path, bytes per device) of params, their optimizer moments and buffers
    that some mesh axis of size > 1 does not split (no dim of the leaf divides by it: see
    `sharding.state_dim_axes`), largest first."""
    params: int
    grads: int
    opt_state: int
    buffers: int
    total: int
    replicated: list[tuple[str, int]]
    replicated_bytes: int
    largest_param: int = 0  # the largest parameter leaf on one device
    # parameter elements stored per device, by the mesh axes compute gathers them over
    # (ZeRO-3: `sharding.state_dim_axes` stores over axes the rules' compute layout does not use)
    gathered: dict[tuple[str, ...], int] = dataclasses.field(default_factory=dict)
    copy_elements: int = 0  # parameter elements per device in a mesh.weights=zero1 copy


def _per_device(v, cfg: Config, sizes: dict[str, int], staged: bool) -> Leaf:
    """An abstract nnx.Variable's Leaf (path left empty): per-device shape, split over every
    mesh axis?, and the axes compute all-gathers it over: those it is stored over beyond the
    rules' layout, and its rules axes that also split the batch (FSDP), but not the experts
    dim's (the tokens travel to the experts). staged: the pipeline runs it (compute_axes)."""
    axes, unplaced = variable_axes(v, cfg.mesh.rules, sizes)
    value = v.get_value()
    shape = tuple(n // math.prod(sizes[a] for a in ax)
                  for n, ax in zip(value.shape, axes, strict=True))
    logical = param_axes(v)
    # FSDP: gathered where the batch is split (inside the pipeline: not over the stage axes)
    tokens = set(stage_local_rules(cfg.mesh.rules).get("batch", ()))
    compute = {a for name, ax in zip(logical, dim_axes(logical, cfg.mesh.rules, sizes,
                                                        value.shape), strict=True)
               for a in ax if a not in tokens or name == "experts"}  # tokens go to experts
    gathered = tuple(a for ax in axes for a in ax if a not in compute)
    copy = compute_axes(logical, cfg.mesh.rules, sizes, value.shape, "zero1", staged=staged)
    copy_elements = math.prod(n // math.prod(sizes[a] for a in ax)
                              for n, ax in zip(value.shape, copy, strict=True))
    return Leaf("", shape, value.dtype, not unplaced, gathered, copy_elements)


def _variable_leaves(state, cfg: Config, sizes: dict[str, int]) -> dict[str, Leaf]:
    """{keystr of the pure-dict path: Leaf} for an nnx.State of abstract variables."""
    staged = pipelined_path(cfg.model, math.prod(sizes[a] for a in cfg.mesh.rules.get(
        "stage", [])))
    tree = nnx.to_pure_dict(jax.tree_util.tree_map_with_path(
        lambda path, v: _per_device(v, cfg, sizes, staged(path)), state,
        is_leaf=lambda x: isinstance(x, nnx.Variable)))
    return {jax.tree_util.keystr(path): dataclasses.replace(leaf, path=jax.tree_util.keystr(path))
            for path, leaf in jax.tree_util.tree_leaves_with_path(
                tree, is_leaf=lambda x: isinstance(x, Leaf))}


_ABSTRACT: dict[str, tuple] = {}  # shape-determining config sections (JSON) -> traced state


def _abstract_state(cfg: Config) -> tuple:
    """(abstract params, buffers, optimizer, abstract opt state) of a config, traced once per
    model and optimizer: a search sizes hundreds of meshes of one model."""
    key = json.dumps([dataclasses.asdict(getattr(cfg, section)) for section in
                      ("model", "attention", "moe", "optimizer", "train")], sort_keys=True)
    if key not in _ABSTRACT:
        model = nnx.eval_shape(lambda: build_model(cfg, cfg.train.seed))
        _, abstract_params, abstract_buffers = nnx.split(model, nnx.Param, RouterBias)
        optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
        opt_state = jax.eval_shape(optimizer.init, nnx.to_pure_dict(abstract_params))
        _ABSTRACT.clear()  # one model at a time: a 671B trace holds a few MB of metadata
        _ABSTRACT[key] = abstract_params, abstract_buffers, optimizer, opt_state
    return _ABSTRACT[key]


def state_leaves(cfg: Config, sizes: dict[str, int]) -> dict[str, list[Leaf]]:
    """{"params", "opt_state", "buffers"}: every leaf with its per-device shape on a mesh of
    these axis sizes (validate's). Optimizer moments take their param's split (as
    make_trainer does through optax.tree_map_params); its other leaves are replicated."""
    abstract_params, abstract_buffers, optimizer, opt_state = _abstract_state(cfg)
    params = _variable_leaves(abstract_params, cfg, sizes)
    buffers = _variable_leaves(abstract_buffers, cfg, sizes)
    pure = nnx.to_pure_dict(abstract_params)
    param_tree = jax.tree_util.tree_map_with_path(
        lambda path, _: params[jax.tree_util.keystr(path)], pure)

    def mirror(moment, param: Leaf) -> Leaf:
        return Leaf("", param.shape, moment.dtype, param.sharded)

    opt_tree = optax.tree_map_params(
        optimizer, mirror, opt_state, param_tree,
        transform_non_params=lambda x: Leaf("", tuple(x.shape), x.dtype, not x.shape),
        is_leaf=lambda x: isinstance(x, Leaf))
    opt = [dataclasses.replace(leaf, path=jax.tree_util.keystr(path))
           for path, leaf in jax.tree_util.tree_leaves_with_path(
               opt_tree, is_leaf=lambda x: isinstance(x, Leaf))]
    return {"params": list(params.values()), "opt_state": opt, "buffers": list(buffers.values())}


def state_bytes(cfg: Config, sizes: dict[str, int]) -> StateBytes:
    """Train-state bytes per device of `cfg` on a mesh of these axis sizes (validate's; any
    device count, whatever this process has). Builds shapes only: nothing is allocated."""
    leaves = state_leaves(cfg, sizes)
    part = {name: sum(leaf.bytes for leaf in group) for name, group in leaves.items()}
    replicated: list[tuple[str, int]] = []
    if math.prod(sizes.values()) > 1:
        for name, group in leaves.items():
            replicated += [(f"{name}{leaf.path}", leaf.bytes) for leaf in group
                           if not leaf.sharded and leaf.shape]  # not the optimizer's counters
    replicated.sort(key=lambda item: (-item[1], item[0]))
    gathered: dict[tuple[str, ...], int] = {}
    for leaf in leaves["params"]:
        if leaf.gathered_over:
            gathered[leaf.gathered_over] = (gathered.get(leaf.gathered_over, 0)
                                            + math.prod(leaf.shape))
    return StateBytes(params=part["params"], grads=part["params"], opt_state=part["opt_state"],
                      buffers=part["buffers"],
                      total=part["params"] + part["opt_state"] + part["buffers"],
                      replicated=replicated, replicated_bytes=sum(b for _, b in replicated),
                      largest_param=max((leaf.bytes for leaf in leaves["params"]), default=0),
                      gathered=gathered,
                      copy_elements=sum(leaf.copy_elements for leaf in leaves["params"]))
