"""The device mesh and the one logical-axis rules table.

Model code names logical axes only (`shard(x, ("batch", "seq", "act_embed"))`, params carry
`axes=(...)` metadata); this module is the only place that knows mesh axis names. Axes are
GSPMD-style `Auto`: XLA propagates shardings between the constraints we place, which keeps
model code free of `out_sharding` plumbing (jax 0.10's `make_mesh` default is Explicit).
Activations follow the rules table (`spec`, `shard`); the train state is stored over every
mesh axis that fits it (`state_dim_axes`, ZeRO-3), and XLA gathers it where it is used.
The pipeline's stages trace under `within_stages`, which takes the stage axes out of every
logical axis but the stacks' (outside the pipeline they split the batch too). Under
mesh.weights zero1 / hsdp compute reads a copy of the params laid out by `compute_axes`, and the
step traces under `compute_copy`, whose rules (`copy_rules`) keep that copy whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from maxmoe.config import MESH_AXES, STACK_AXES, stage_local_rules

_RULES: contextvars.ContextVar[dict[str, list[str]] | None] = contextvars.ContextVar("rules", default=None)
_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("mesh", default=None)
# (mesh.weights, DCN factors, the rules before copy_rules) while the step traces on a compute
# copy (compute_copy)
_COPY: contextvars.ContextVar[tuple[str, dict, dict] | None] = contextvars.ContextVar(
    "copy", default=None)
# the compute copy's replica axes (stacks', sublayers'), and those vmapped over now
_COPY_REPLICAS: contextvars.ContextVar[tuple] = contextvars.ContextVar("copies", default=((), ()))
_REPLICAS: contextvars.ContextVar[tuple] = contextvars.ContextVar("replicas", default=())
# the batch axes that are data parallelism alone: ZeRO-1/HSDP replicate compute weights over them
DATA_PARALLEL_AXES = ("data", "fsdp")


def make_mesh(sizes: dict[str, int], devices: Sequence[jax.Device] | None = None,
              dcn: dict[str, int] | None = None) -> Mesh:
    """A mesh with axes in MESH_AXES order (data outermost, tensor innermost).

    dcn: the factor of each axis that spans hosts. Devices are grouped by host (process; on
    one process, consecutive equal groups stand in for hosts) and every axis is laid out as
    dcn (outer) x ici (inner), so the ici part of each axis stays inside one host.
    """
    shape = tuple(sizes[a] for a in MESH_AXES)
    devices = list(devices if devices is not None else jax.devices())
    if int(np.prod(shape)) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, shape, strict=True))} needs {int(np.prod(shape))} devices, "
                         f"got {len(devices)}")
    types = (AxisType.Auto,) * len(MESH_AXES)
    dcn_shape = tuple((dcn or {}).get(a, 1) for a in MESH_AXES)
    if int(np.prod(dcn_shape)) == 1:
        return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
    ici_shape = tuple(s // d for s, d in zip(shape, dcn_shape, strict=True))
    hosts = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.array(hosts, dtype=object).reshape(*dcn_shape, *ici_shape)
    n = len(MESH_AXES)  # interleave (dcn_a, ici_a) per axis, then merge each pair
    grid = grid.transpose([i for a in range(n) for i in (a, n + a)]).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=types)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: dict[str, list[str]]) -> Iterator[Mesh]:
    """Makes `mesh` and `rules` current for `shard`, `spec` and jit (jax.set_mesh)."""
    t1, t2 = _RULES.set(rules), _MESH.set(mesh)
    try:
        with jax.set_mesh(mesh):
            yield mesh
    finally:
        _RULES.reset(t1)
        _MESH.reset(t2)


@contextlib.contextmanager
def within_stages() -> Iterator[None]:
    """Makes `stage_local_rules` of the current rules current (the pipeline traces its stage
    body under it: `shard`, `spec` and `mesh_axes`, e.g. mesh_axes("batch"), then leave the
    stage axes to the vmap over stages); the current rules again on exit."""
    token = _RULES.set(stage_local_rules(_RULES.get() or {}))
    try:
        yield
    finally:
        _RULES.reset(token)


def current_mesh() -> Mesh | None:
    return _MESH.get()


def mesh_device():
    """The first device of the current mesh, else jax.devices()[0]: kernels' `auto` choices
    follow the devices the step is compiled for, which differ from the process's in a
    deviceless GPU compile (maxmoe/plan/gpu_aot.py)."""
    mesh = _MESH.get()
    if mesh is not None and mesh.devices.size:
        return mesh.devices.flat[0]
    return jax.devices()[0]


def mesh_platform() -> str:
    """The platform ("cpu", "gpu", "tpu") of mesh_device()."""
    return mesh_device().platform


def dim_axes(logical: Sequence[str | None], rules: Mapping[str, list[str]],
             sizes: Mapping[str, int] | None = None,
             shape: Sequence[int] | None = None) -> list[tuple[str, ...]]:
    """The mesh axes each dimension of an activation is split over (`spec`, `shard`); the
    train state's storage starts from it (`state_dim_axes`).

    A mesh axis is used at most once per spec. With `sizes` (mesh axis -> size), size-1 axes
    are dropped, and with `shape` too, a dimension the chosen axes do not divide stays whole
    (e.g. a 1-layer stack on 4 pipeline stages); config validation rejects the cases where
    that would be wrong. Needs no mesh object, so a planner can ask for any cluster size.
    """
    used: set[str] = set()
    out = []
    for dim, name in enumerate(logical):
        axes = [a for a in (rules.get(name, []) if name else []) if a not in used]
        if sizes is not None:  # size-1 axes add nothing and keep specs readable
            axes = [a for a in axes if sizes[a] > 1]
            if shape is not None and shape[dim] % math.prod(sizes[a] for a in axes):
                axes = []
        used.update(axes)
        out.append(tuple(axes))
    return out


def spec(logical: Sequence[str | None], rules: dict[str, list[str]] | None = None,
         shape: Sequence[int] | None = None) -> P:
    """Logical axis names -> PartitionSpec under the current mesh (see `dim_axes`)."""
    rules = rules if rules is not None else (_RULES.get() or {})
    mesh = _MESH.get()
    sizes = dict(mesh.shape) if mesh is not None else None
    return as_spec(dim_axes(logical, rules, sizes, shape))


def as_spec(axes: Sequence[tuple[str, ...]]) -> P:
    """Mesh axes per dim (compute_axes, dim_axes) -> a PartitionSpec."""
    return P(*(ax if len(ax) > 1 else (ax[0] if ax else None) for ax in axes))


def entry_axes(entry) -> tuple[str, ...]:
    """One PartitionSpec entry (None, an axis name or a tuple of them) -> its mesh axes."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def state_dim_axes(logical: Sequence[str | None], rules: Mapping[str, list[str]],
                   sizes: Mapping[str, int],
                   shape: Sequence[int]) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """Where a train-state leaf (param, optimizer moment, buffer) is stored: ZeRO-3 over every
    mesh axis of size > 1 that some dimension can take. Returns (mesh axes per dim, unplaced).

    1. Each dim takes those of its rules axes (`dim_axes`' choice) that divide what is left
       of it, in order; an axis that does not divide is set aside, not dropped.
    2. The set-aside axes and every mesh axis the rules left unused go, largest axis first,
       onto the dim with the most elements per device that they divide (never a STACK_AXES
       dim), after that dim's own axes: compute reads the rules' sharding back with an
       all-gather over the added axes alone (FSDP-style).
    3. `unplaced`: the axes no dim can take; the leaf is replicated over them.
    Activations keep `dim_axes` (`spec`, `shard`); on one device nothing changes.
    """
    live = [a for a in MESH_AXES if sizes.get(a, 1) > 1]
    per_device = list(shape)
    out: list[tuple[str, ...]] = []
    used: set[str] = set()
    for dim, name in enumerate(logical):
        kept = []
        for a in (rules.get(name, []) if name else []):
            if a in live and a not in used and per_device[dim] % sizes[a] == 0:
                kept.append(a)
                used.add(a)
                per_device[dim] //= sizes[a]
        out.append(tuple(kept))
    unplaced = []
    for a in sorted((a for a in live if a not in used), key=lambda a: -sizes[a]):
        fits = [d for d, name in enumerate(logical)
                if name not in STACK_AXES and per_device[d] % sizes[a] == 0]
        if not fits:
            unplaced.append(a)
            continue
        dim = max(fits, key=lambda d: per_device[d])  # the first of equals
        out[dim] += (a,)
        per_device[dim] //= sizes[a]
    return out, tuple(unplaced)


def named(logical: Sequence[str | None]) -> NamedSharding:
    mesh = _MESH.get()
    assert mesh is not None, "named() needs use_mesh()"
    return NamedSharding(mesh, spec(logical))


def shard(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Constrains an activation's sharding by logical names; identity without a mesh."""
    if _MESH.get() is None:
        return x
    return jax.lax.with_sharding_constraint(x, spec(logical))


def path_keys(path) -> tuple:
    """A jax.tree_util key path -> its pure-dict keys, e.g. ("layer_groups", 1, "mlp", "up")."""
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def param_axes(variable) -> tuple[str | None, ...]:
    """Logical axes of a param; stacked (scanned) layers get a leading 'layers' axis."""
    axes = tuple(variable.get_metadata().get("axes", ()))
    extra = variable.get_value().ndim - len(axes)
    return ("layers",) * extra + axes


def variable_axes(v, rules: Mapping[str, list[str]],
                  sizes: Mapping[str, int]) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """`state_dim_axes` of an nnx.Variable. One created with `store_by_rules=True` metadata
    (the router bias: [E] per layer, read whole by every step's routing) keeps the rules' axes
    alone, the other axes returned as unplaced: spread over extra axes, it made XLA replicate
    router tensors under the pipeline's vmap ("Involuntary full rematerialization")."""
    logical, shape = param_axes(v), v.get_value().shape
    if not v.get_metadata().get("store_by_rules"):
        return state_dim_axes(logical, rules, sizes, shape)
    axes = dim_axes(logical, rules, sizes, shape)
    used = {a for ax in axes for a in ax}
    return axes, tuple(a for a in MESH_AXES if sizes.get(a, 1) > 1 and a not in used)


def compute_axes(logical: Sequence[str | None], rules: Mapping[str, list[str]],
                 sizes: Mapping[str, int], shape: Sequence[int], weights: str,
                 dcn: Mapping[str, int] | None = None,
                 staged: bool | None = None) -> list[tuple[str, ...]]:
    """The mesh axes each dim of a param's compute copy is split over under mesh.weights:

    - zero3: its storage (`state_dim_axes`); compute gathers it at every use;
    - zero1: the rules' own axes as `copy_rules` leaves them (experts over the expert axis,
      tensor dims over tensor, the stack over the stages), replicated over the rest; a stack
      the stages do not divide (V3's 58 MoE layers on 16) keeps the stage axes where storage
      puts them, so a device holds its stage's share, as `stack_source_spec` reads it; one
      the pipeline does not run (`staged` False; None: not a stack) is replicated over them,
      as they split its rows (else gathered at every outer row group);
    - hsdp: the rules' own axes but the data-parallel ones that span hosts (`copy_rules`),
      plus the storage axes that stay inside a host (DCN factor 1 in `dcn`), each on the dim
      storage puts it: gathered over NVLink per use, never across hosts.
    """
    stored, _ = state_dim_axes(logical, rules, sizes, shape)
    if weights == "zero3":
        return stored
    own = dim_axes(logical, copy_rules(rules, weights, dcn or {}), sizes, shape)
    staged = logical[:1] == ("layers",) if staged is None else staged
    keep = set(rules.get("stage", [])) if staged else set()
    if weights == "hsdp":
        keep |= {a for a in sizes if (dcn or {}).get(a, 1) == 1}
    out, used = [], {a for ax in own for a in ax}
    for mine, theirs in zip(own, stored, strict=True):
        extra = tuple(a for a in theirs if a in keep and a not in used)
        used.update(extra)
        out.append(mine + extra)
    return out


def copy_rules(rules: Mapping[str, list[str]], weights: str,
               dcn: Mapping[str, int]) -> dict[str, list[str]]:
    """`rules` as model code sees them on a compute copy: the axes the copy is replicated over
    dropped from every logical axis but "batch" and the stacks' (STACK_AXES), so a weight's own
    sharding constraint (e.g. the LM head's) keeps the copy whole instead of slicing and
    re-gathering it at every use. Those axes: DATA_PARALLEL_AXES and the stage axes, which
    outside the pipeline split the batch like data (inside it, `within_stages` drops them from
    these axes anyway); all of them under zero1, under hsdp those that span hosts."""
    if weights == "zero3":
        return dict(rules)
    parallel = set(DATA_PARALLEL_AXES) | set(rules.get("stage", []))
    drop = {a for a in parallel if weights == "zero1" or dcn.get(a, 1) > 1}
    return {k: list(v) if k == "batch" or k in STACK_AXES else [a for a in v if a not in drop]
            for k, v in rules.items()}


def copy_groups(rules: Mapping[str, list[str]], weights: str,
                dcn: Mapping[str, int]) -> tuple[str, ...]:
    """The axes a compute copy holds one replica of each stacked param per group of,
    [G, L, ...] split over them (train/gradients.py ComputeCopy): the data-parallel axes that
    split the batch and the copy is replicated over (zero1: DATA_PARALLEL_AXES; hsdp: those
    spanning hosts); () under zero3. Why: the stacks run vmapped over the replicas
    (parallel/replicas.py), so the scans reduce no gradient over these axes."""
    if weights == "zero3":
        return ()
    return tuple(a for a in DATA_PARALLEL_AXES if a in rules.get("batch", [])
                 and (weights == "zero1" or dcn.get(a, 1) > 1))


def replica_axes(inside: bool = False, sublayers: bool = False) -> tuple[str, ...]:
    """The axes the compute copy holds the stacks' replicas over (compute_copy), () off it or
    within_replicas; inside: the axes the current `within_replicas` splits instead; sublayers:
    within a stack's replicas, the expert axes of the non-expert params' (replicas.py)."""
    now, (stacks, subs) = _REPLICAS.get(), _COPY_REPLICAS.get()
    if sublayers:
        return subs if now and not set(subs) & set(now) else ()
    return now if inside else () if now else stacks


@contextlib.contextmanager
def within_replicas(axes: tuple[str, ...]) -> Iterator[None]:
    """The rules with `axes` dropped from every logical axis but STACK_AXES while a stack (or
    sublayer) runs vmapped over its replicas (parallel/replicas.py), as `within_stages` does."""
    rules = _RULES.get() or {}
    t1 = _RULES.set({k: list(v) if k in STACK_AXES else [a for a in v if a not in axes]
                     for k, v in rules.items()})
    t2 = _REPLICAS.set(_REPLICAS.get() + tuple(axes))  # nested: sublayers' inside a stack's
    try:
        yield
    finally:
        _REPLICAS.reset(t2)
        _RULES.reset(t1)


@contextlib.contextmanager
def compute_copy(weights: str, dcn: Mapping[str, int], replicas: tuple[str, ...] = (),
                 sublayers: tuple[str, ...] = ()) -> Iterator[None]:
    """The step traces on a compute copy laid out by `compute_axes` (mesh.weights zero1 /
    hsdp): `stack_source_spec` reads the stack from that layout, not storage's, and `shard` /
    `spec` use `copy_rules`; the stacks run on their replicas over mesh axes `replicas`
    (`replica_axes`), their non-expert params' over `sublayers` too. Old rules on exit."""
    rules = _RULES.get() or {}
    t1 = _COPY.set((weights, dict(dcn), dict(rules)))
    t2 = _RULES.set(copy_rules(rules, weights, dcn))
    t3 = _COPY_REPLICAS.set((tuple(replicas), tuple(sublayers)))
    try:
        yield
    finally:
        _COPY_REPLICAS.reset(t3)
        _RULES.reset(t2)
        _COPY.reset(t1)


def on_compute_copy() -> bool:
    """Whether the step traces on a compute copy (mesh.weights zero1 / hsdp; compute_copy)."""
    return _COPY.get() is not None


def stack_source_spec(variable, rules: Mapping[str, list[str]] | None = None,
                      sizes: Mapping[str, int] | None = None) -> P:
    """The spec the pipeline regroups a stacked layer param [L, ...] from
    (parallel/stage_weights.py `stage_layout`), under `rules` and mesh axis `sizes` (default:
    the current ones): the rules' own (`dim_axes`), and where the stage axes split none of its
    dims (P does not divide L), the stage axes added, minor, to the dim the train state stores
    them on (`variable_axes`), so each device reads 1/P of the stack instead of all of it (e.g.
    V3's 58 MoE layers on 16 stages). The rules' spec where storage keeps them off every dim, or
    that dim cannot take them (e.g. the router bias, stored by the rules alone)."""
    rules = rules if rules is not None else (_RULES.get() or {})
    mesh = _MESH.get()
    sizes = sizes if sizes is not None else dict(mesh.shape) if mesh is not None else None
    logical, shape = param_axes(variable), variable.get_value().shape
    copy = _COPY.get()
    if copy is not None and sizes is not None:  # zero1 / hsdp: the compute copy's layout
        weights, dcn, stored_rules = copy
        # a stack the pipeline runs (whatever its leading name inside a replicas' vmap): it
        # keeps the stage axes where storage puts them, else each stage would read all of it
        return as_spec(compute_axes(logical, stored_rules, sizes, shape, weights, dcn,
                                    staged=True))
    axes = dim_axes(logical, rules, sizes, shape)
    stage = [a for a in rules.get("stage", []) if sizes and sizes[a] > 1]
    if not stage or any(set(ax) & set(stage) for ax in axes):
        return as_spec(axes)
    stored, _ = variable_axes(variable, rules, sizes)
    for d, ax in enumerate(stored):
        if d and set(stage) <= set(ax):
            if shape[d] % math.prod(sizes[a] for a in (*axes[d], *stage)) == 0:
                axes[d] = (*axes[d], *stage)
            break
    return as_spec(axes)


def state_shardings(state, mesh: Mesh | AbstractMesh, rules: dict[str, list[str]]):
    """NamedSharding for every nnx.Variable in an nnx.State: params by their axes metadata,
    placed for storage by `state_dim_axes` (over every mesh axis that fits). Needs no current
    mesh, so an AbstractMesh of any size works too (shapes only)."""
    sizes = dict(mesh.shape)

    def one(v):
        if isinstance(v, nnx.Variable):
            axes, _ = variable_axes(v, rules, sizes)
            return v.replace(NamedSharding(mesh, as_spec(axes)))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def global_batch(local: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """This process's rows -> one global jax.Array per key, sharded over the batch axes."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def mesh_axes(logical: str) -> tuple[str, ...]:
    """The mesh axes (of size > 1) a logical axis maps to under the current mesh and rules."""
    mesh, rules = _MESH.get(), _RULES.get() or {}
    if mesh is None:
        return ()
    return tuple(a for a in rules.get(logical, []) if mesh.shape[a] > 1)
