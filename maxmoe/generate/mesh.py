"""Decoding's mesh and sharding rules.

A decode batch is a few prompts (often one), which cannot be split like a training batch:
the batch axis keeps only those of the run's batch mesh axes whose sizes divide it (none for
one prompt). Weights keep the run's rules, placed by them alone (no ZeRO spreading: every
step reads every weight): heads, MLP and vocab over `tensor`, experts over `expert`.
Decoding runs no pipeline.
"""

from __future__ import annotations

import math

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from maxmoe.config import MESH_AXES, Config, ConfigError
from maxmoe.sharding import make_mesh, param_axes, spec, use_mesh


def parse_mesh(text: str) -> dict[str, int]:
    """'tensor=2,expert=4' -> {"tensor": 2, "expert": 4}; raises ConfigError on a bad entry."""
    sizes: dict[str, int] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        if name not in MESH_AXES or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"--mesh {text!r}: bad entry {item!r}; write AXIS=SIZE pairs "
                              f"with AXIS one of {', '.join(MESH_AXES)}, e.g. tensor=2,expert=4")
        sizes[name] = int(value)
    if sizes.get("pipeline", 1) > 1:
        raise ConfigError(f"--mesh {text!r}: decoding runs no pipeline; drop pipeline= and use "
                          "tensor= or expert= for the devices instead")
    return sizes


def decode_mesh_sizes(cfg: Config, override: dict[str, int] | None = None) -> dict[str, int]:
    """Every mesh axis's size: the override's, else the run's tensor, expert and fsdp sizes
    with data = 1 and pipeline = 1."""
    sizes = {a: 1 for a in MESH_AXES}
    sizes.update(tensor=cfg.mesh.tensor, expert=cfg.mesh.expert, fsdp=cfg.mesh.fsdp)
    if override is not None:
        sizes = {a: override.get(a, 1) for a in MESH_AXES}
    need, have = math.prod(sizes.values()), jax.device_count()
    if need > have:
        raise ConfigError(f"decode mesh {sizes} needs {need} devices, {have} present; pass a "
                          "smaller --mesh (e.g. --mesh tensor=1)")
    return sizes


def decode_rules(cfg: Config, sizes: dict[str, int], batch: int) -> dict[str, list[str]]:
    """The run's rules with `batch` cut to its leading mesh axes whose sizes divide `batch`."""
    rules = {k: list(v) for k, v in cfg.mesh.rules.items()}
    kept, product = [], 1
    for axis in rules.get("batch", []):
        if sizes[axis] == 1:
            continue
        if batch % (product * sizes[axis]):
            break
        kept.append(axis)
        product *= sizes[axis]
    rules["batch"] = kept
    return rules


def place(model: nnx.Module, sizes: dict[str, int],
          rules: dict[str, list[str]]) -> tuple[Mesh, nnx.GraphDef, nnx.State]:
    """(mesh over the first devices, graphdef, state on it): each variable split over its
    rules' mesh axes that divide it, replicated over the rest."""
    mesh = make_mesh(sizes, jax.devices()[:math.prod(sizes.values())])
    graphdef, state = nnx.split(model)
    with use_mesh(mesh, rules):
        shardings = jax.tree.map(
            lambda v: v.replace(NamedSharding(mesh, spec(param_axes(v), rules,
                                                         v.get_value().shape))),
            state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return mesh, graphdef, jax.device_put(state, shardings)
