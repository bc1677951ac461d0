"""Bytes one device sends per train step, by mesh axis and collective kind, read from the
compiled (SPMD-partitioned) HLO text of `jax.jit(...).lower(...).compile().as_text()`.

Convention: the usual ring / bandwidth-optimal figures for a group of n devices, from the
per-device buffers in the HLO: all-gather (n-1)/n x result (= (n-1) x operand), reduce-scatter
(n-1)/n x operand, all-reduce 2(n-1)/n x operand, all-to-all (n-1)/n x operand (a
ragged-all-to-all counts as an all-to-all of its whole input buffer: an upper bound),
collective-permute the operand, for each device that sends. Figures are averaged over all
devices of the mesh.

Inside a host (ICI) or across hosts (DCN): a device whose group of n has g members on its own
host exchanges with g-1 peers inside and n-g outside, so (g-1)/(n-1) of its bytes are
counted as ICI and (n-g)/(n-1) as DCN. That is a flat ring/all-pairs assumption;
hierarchical NCCL algorithms (intra-host reduce, then inter-host) send less across hosts.
A permute is ICI when source and target share a host, else DCN.

Loops: a collective inside a `while` body counts trip-count times
(backend_config known_trip_count, nested loops multiply); a loop without a known trip count
counts once and adds a warning. The all-to-all transport's rounds loops (named scope
all_to_all.ROUNDS_SCOPE) count once: their static trip count is the worst routing's, and a
ragged exchange sends each assignment once over all rounds, at most one round's whole
buffer (c T K rows) at moe.transport_buffer_factor c >= 1. A `conditional` counts its most
expensive branch once (the step guard's update branch is what runs on normal steps).
Computations reached by call, fusion, async wrappers and reducers count with their caller's
multiplier.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterator

import numpy as np
from jax.sharding import Mesh

from maxmoe.parallel.all_to_all import ROUNDS_SCOPE
from maxmoe.plan.hlo import (
    Instr,
    attr,
    callees,
    close_bracket,
    known_trip_count,
    parse_module,
    shape_bytes,
)
from maxmoe.plan.scatter import scattered_parts, use_index

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

# the rounds loop itself: op_name ".../exchange_rounds/while", or with the custom_vjp's call
# between them (".../exchange_rounds/eval_jaxpr/while" from XLA:GPU, ".../closed_call/while"
# from XLA:CPU); loops inside its body (".../while/body/...") are not it
ROUNDS_LOOP = re.compile(
    rf'op_name="[^"]*/{ROUNDS_SCOPE}/(?:(?:eval_jaxpr|closed_call)/)*while"')

_OPCODE_KIND = {k: k for k in KINDS} | {"ragged-all-to-all": "all-to-all"}

Bytes = dict[tuple[str, str], np.ndarray]  # (axis label, kind) -> [ici, dcn]


@dataclasses.dataclass(frozen=True)
class CommBytes:
    """by_axis: {axis_label: {kind: {"ici": bytes, "dcn": bytes}}}, bytes one device sends per
    step (mesh axes of size > 1 that vary inside a group, joined with "+" in mesh order).
    warnings: loops counted once for want of a known trip count, and unparsed collectives."""
    by_axis: dict[str, dict[str, dict[str, float]]]
    warnings: list[str]

    def total(self, link: str) -> float:
        """All bytes over `link` ("ici" or "dcn")."""
        return sum(v[link] for kinds in self.by_axis.values() for v in kinds.values())


def _iota(text: str) -> np.ndarray:
    """`[d0,d1]T(p0,p1)` or `[d0,d1]` (XLA's iota tile assignment) -> the flat id order."""
    m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    if not m:
        raise ValueError(f"cannot parse iota device list {text!r}")
    dims = [int(d) for d in m.group(1).split(",")]
    arr = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(2):
        arr = arr.transpose([int(p) for p in m.group(2).split(",")])
    return arr.reshape(-1)


def _device_list(text: str) -> np.ndarray:
    """`[dims]T(perm)` (iota) or `0,1,2,...` -> flat device ids."""
    text = text.strip()
    if text.startswith("["):
        return _iota(text)
    return np.array([int(x) for x in text.split(",")])


def _mesh_groups(attrs: str) -> list[list[int]]:
    """The mesh-axes form: `replica_groups=mesh['a'=2,'b'=4], device_ids=(...) {'b'}` (or a
    sub-axis `'b':(pre)size`): groups are the devices that differ only along those axes."""
    start = attrs.index("replica_groups=mesh[") + len("replica_groups=mesh")
    end = close_bracket(attrs, start)
    axes = re.findall(r"'([^']+)'=(\d+)", attrs[start:end])
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    rest = attrs[end + 1:]
    ids = np.arange(int(np.prod(sizes)))
    dev = re.match(r"\s*,\s*device_ids=\(", rest)
    if dev:
        close = close_bracket(rest, dev.end() - 1)
        ids, rest = _device_list(rest[dev.end():close]), rest[close + 1:]
    brace = rest.index("{")
    refs = re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", rest[brace:close_bracket(rest, brace)])
    dims: list[int] = []
    grouped: list[int] = []
    for axis, size in zip(names, sizes, strict=True):
        subs = sorted((int(p or 1), int(s or size)) for a, p, s in refs if a == axis)
        done = 1
        for pre, sub in subs:  # split the axis into [pre/done, sub, ...]: group the sub part
            if pre > done:
                dims.append(pre // done)
            grouped.append(len(dims))
            dims.append(sub)
            done = pre * sub
        if done < size:
            dims.append(size // done)
    keep = [d for d in range(len(dims)) if d not in grouped]
    n = int(np.prod([dims[d] for d in grouped]))
    return ids.reshape(dims).transpose(keep + grouped).reshape(-1, n).tolist()


def replica_groups(attrs: str, num_partitions: int) -> list[list[int]]:
    """The device groups of a collective: explicit `{{0,1},{2,3}}`, iota `[G,N]<=[dims]T(p)`,
    the mesh-axes form, or none/empty (all partitions in one group)."""
    if "replica_groups=mesh[" in attrs:
        return _mesh_groups(attrs)
    value = attr(attrs, "replica_groups")
    if value is None or re.fullmatch(r"\{\s*\}", value):
        return [list(range(num_partitions))]
    if value.startswith("{"):
        return [[int(x) for x in g.split(",") if x.strip()]
                for g in re.findall(r"\{([\d,\s]*)\}", value[1:-1])]
    m = re.fullmatch(r"\[(\d+),(\d+)\]<=(.*)", value)
    if not m:
        raise ValueError(f"cannot parse replica_groups={value}")
    return _iota(m.group(3)).reshape(int(m.group(1)), int(m.group(2))).tolist()


def source_target_pairs(attrs: str) -> list[tuple[int, int]]:
    """collective-permute's `source_target_pairs={{0,1},{1,0}}`."""
    value = attr(attrs, "source_target_pairs") or "{}"
    return [(int(s), int(t)) for s, t in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", value)]


class _Topology:
    """Partition id -> mesh coordinates and host (partition i is mesh.devices.flat[i])."""

    def __init__(self, mesh: Mesh, devices_per_host: int):
        self.names = [a for a, s in mesh.shape.items() if s > 1]
        shape = mesh.devices.shape
        coords = np.array(np.unravel_index(np.arange(mesh.devices.size), shape)).T
        self.coords = coords[:, [i for i, s in enumerate(shape) if s > 1]]
        self.host = np.array([d.id // devices_per_host for d in mesh.devices.flat])
        self.size = mesh.devices.size

    def label(self, groups) -> str:
        """Mesh axes (size > 1) whose coordinate varies inside any of `groups` (an array of
        partition ids, one group per row), "+"-joined in mesh order."""
        c = self.coords[np.asarray(groups).reshape(-1, np.shape(groups)[-1])]
        varies = (c != c[:, :1]).any(axis=(0, 1))
        return "+".join(a for a, v in zip(self.names, varies, strict=True) if v)

    def union_label(self, labels: list[str]) -> str:
        """Axes named in any of `labels`, in mesh order."""
        used = {a for lab in labels for a in lab.split("+") if a}
        return "+".join(a for a in self.names if a in used)


def _operand_bytes(ins: Instr, symbols: dict[str, str]) -> float:
    """Bytes of the operands that carry data (the first only for ragged-all-to-all and an
    in-place collective-permute, whose other operands are offsets and output buffers)."""
    ops = ins.operands
    if ins.opcode.startswith("ragged-all-to-all") or "slice_sizes=" in ins.attrs:
        ops = ops[:1]
    total = 0.0
    for op in ops:
        parts = op.rsplit(None, 1)
        name = parts[-1].lstrip("%")
        total += shape_bytes(parts[0] if len(parts) == 2 else symbols[name])
    return total


_GROUP_FACTOR = {"all-gather": lambda n: n - 1, "reduce-scatter": lambda n: (n - 1) / n,
                 "all-to-all": lambda n: (n - 1) / n, "all-reduce": lambda n: 2 * (n - 1) / n}


class _Context:
    """What pricing one instruction needs beyond itself: result shapes by name, the mesh
    topology, the module's computations and their uses (for `scatter.scattered_parts`)."""

    def __init__(self, comps: dict[str, list[Instr]], topo: _Topology):
        self.comps, self.topo = comps, topo
        self.symbols = {ins.name: ins.type for body in comps.values() for ins in body}
        self.uses = use_index(comps)


def _parts(ins: Instr, kind: str, size: float, ctx: _Context, comp: str,
           n: int) -> list[tuple[str, float]]:
    """[(kind, operand bytes)] of one collective over groups of n: an all-reduce's parts
    that are only sliced to 1/n afterwards count as a reduce-scatter (maxmoe/plan/scatter.py),
    the rest as an all-reduce."""
    if kind != "all-reduce":
        return [(kind, size)]
    scattered = sum(shape_bytes(p) for p in scattered_parts(ctx.comps, ctx.uses, comp, ins, n))
    scattered = min(scattered, size)
    return [(k, b) for k, b in (("all-reduce", size - scattered),
                                ("reduce-scatter", scattered)) if b > 0]


def _collective(ins: Instr, ctx: _Context, comp: str) -> Bytes:
    """The mesh-averaged [ici, dcn] bytes one collective instruction (of computation `comp`)
    sends, keyed by (axis label, kind); empty for anything that is not a collective (or its
    -done half)."""
    kind, topo = _OPCODE_KIND.get(ins.opcode.removesuffix("-start")), ctx.topo
    if kind is None:
        return {}
    size = _operand_bytes(ins, ctx.symbols)
    if kind == "collective-permute":
        link = np.zeros(2)
        pairs = [(s, t) for s, t in source_target_pairs(ins.attrs) if s != t]
        for s, t in pairs:
            link[0 if topo.host[s] == topo.host[t] else 1] += size
        label = topo.label(pairs) if pairs else ""
        return {(label, kind): link / topo.size} if label and link.sum() > 0 else {}
    groups = [g for g in replica_groups(ins.attrs, topo.size) if len(g) > 1]
    labels, links = [], {}
    for n in sorted({len(g) for g in groups}):  # one array per group size
        ids = np.array([g for g in groups if len(g) == n])
        hosts = topo.host[ids]
        same = (hosts[:, :, None] == hosts[:, None, :]).sum(-1)  # own-host members
        split = np.array([np.sum(same - 1), np.sum(n - same)]) / (n - 1)
        for part, part_size in _parts(ins, kind, size, ctx, comp, n):
            links[part] = links.get(part, np.zeros(2)) + _GROUP_FACTOR[part](n) * part_size * split
        labels.append(topo.label(ids))
    label = topo.union_label(labels)
    return {(label, k): v / topo.size for k, v in links.items() if label and v.sum() > 0}


def _add(into: Bytes, other: Bytes, times: float = 1.0) -> None:
    for key, v in other.items():
        into[key] = into.get(key, np.zeros(2)) + times * v


def _walk(ctx: _Context, warnings: list[str]):
    """cost(computation) -> Bytes of one execution of it, loops and callees included."""

    @functools.cache
    def cost(name: str) -> Bytes:
        total: Bytes = {}
        comps = ctx.comps
        for ins in comps[name]:
            try:
                _add(total, _collective(ins, ctx, name))
            except (ValueError, KeyError) as e:
                warnings.append(f"{ins.opcode} {ins.name}: not counted ({e})")
            if ins.opcode.endswith(("-done", "-update")):
                continue  # the -start half already counted its wrapped computation
            subs = [cost(c) for c in callees(ins) if c in comps]
            if ins.opcode == "conditional":
                _add(total, max(subs, key=lambda b: sum(v.sum() for v in b.values()),
                                default={}))
                continue
            times = 1.0
            if ins.opcode == "while":
                trip = known_trip_count(ins)
                inner = sum(v.sum() for b in subs for v in b.values())
                if trip is not None:  # the rounds loop: once (module docstring)
                    times = 1.0 if ROUNDS_LOOP.search(ins.attrs) else float(trip)
                elif inner > 0:
                    warnings.append(f"while {ins.name}: no known trip count, its collectives "
                                    f"({inner:.4g} bytes per iteration) counted once")
            for sub in subs:
                _add(total, sub, times)
        return total

    return cost


def instruction_pricer(comps: dict[str, list[Instr]], mesh: Mesh,
                       devices_per_host: int) -> Callable[[Instr, str], Bytes]:
    """price(ins, computation) -> {(axis label, kind): [ici, dcn]}: the mesh-averaged bytes one
    execution of one collective instruction (plain or -start) of `computation` sends, by the
    module docstring's convention; {} for any other instruction. For plan/overlap.py, which
    times each collective of the schedule on its own."""
    ctx = _Context(comps, _Topology(mesh, devices_per_host))
    return lambda ins, comp: _collective(ins, ctx, comp)


def collective_bytes(hlo_text: str, mesh: Mesh, devices_per_host: int) -> CommBytes:
    """Bytes one device sends per step by mesh axis, kind and link (module docstring).

    hlo_text: `compiled.as_text()` of the SPMD-partitioned step on `mesh` (partition i is
    mesh.devices.flat[i]); devices_per_host: a device's host is its id // devices_per_host.
    """
    comps, entry = parse_module(hlo_text)
    warnings: list[str] = []
    total = _walk(_Context(comps, _Topology(mesh, devices_per_host)), warnings)(entry)
    by_axis: dict[str, dict[str, dict[str, float]]] = {}
    for (label, kind), (ici, dcn) in sorted(total.items()):
        by_axis.setdefault(label, {})[kind] = {"ici": float(ici), "dcn": float(dcn)}
    return CommBytes(by_axis, warnings)


def _rows(result: CommBytes) -> Iterator[tuple[str, str, float, float]]:
    for label, kinds in result.by_axis.items():
        for kind, v in kinds.items():
            yield label, kind, v["ici"], v["dcn"]


def summarize(result: CommBytes) -> str:
    """A short table: axis, kind, GB inside a host, GB across hosts (per device per step),
    then a total line and the warnings."""
    lines = [f"{'axis':<24} {'kind':<20} {'GB inside':>12} {'GB across':>12}"]
    for label, kind, ici, dcn in _rows(result):
        lines.append(f"{label:<24} {kind:<20} {ici / 1e9:>12.4g} {dcn / 1e9:>12.4g}")
    lines.append(f"{'total':<45} {result.total('ici') / 1e9:>12.4g} "
                 f"{result.total('dcn') / 1e9:>12.4g}")
    return "\n".join(lines + [f"warning: {w}" for w in result.warnings])
