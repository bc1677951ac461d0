"""The communication time XLA:GPU's schedule leaves exposed, read from the optimised, scheduled
HLO of an XLA:GPU compile (`compiled.as_text()`: `is_scheduled=true`, each computation's
instructions printed in the order they run). Replaces roofline.COMM_OVERLAP's assumption where
the compile is XLA:GPU's (issue 41, item 5).

The rule: a collective's exposed time is its roofline time less the roofline time of the compute
scheduled strictly between its start and its done, never below 0, where
- a collective's roofline time is the bytes one device sends for it (collectives.py's convention,
  mesh-averaged; the expert all-to-all scaled to the bytes the plan prices it at) over the
  cluster's ici and dcn bandwidths; its link is dcn when any of its bytes cross hosts, else ici;
- a compute op's roofline time is max(GEMM FLOPs / GEMM rate + attention FLOPs / attention rate,
  HBM bytes / HBM bandwidth), rates from the device file (cluster_rates), FLOPs and bytes as
  op_cost.py counts them (Mosaic GPU kernels estimated from their shapes; other custom calls by
  their bytes only, a lower bound, listed in `uncounted_custom_calls`);
- each compute op is credited once: its time goes to the collectives in flight in the order they
  started, so two collectives in flight together cannot both hide under one op;
- collectives on one link are serialised in the order they started: at a collective's done, those
  started before it on its link finish first, and what of them was not hidden is exposed there;
- a synchronous collective (a plain all-gather, all-reduce, ..., or a start that XLA marked
  is_sync) is fully exposed, and listed by kind, bytes and op_name;
- a `while` body is evaluated on its own and multiplied by its trip count, as collectives.py
  counts it (known_trip_count; the all-to-all rounds loop once; an unknown count once, with a
  warning); the compute of the body that hid none of the body's own collectives is what the loop
  offers to collectives in flight around it. A `conditional` counts its costliest branch, a
  `call` its body; an `async-start` that wraps no collective is compute.
Not modelled: NCCL's kernels competing with compute for SMs and HBM (optimistic), collectives on
different links running together under one op (pessimistic).
"""

from __future__ import annotations

import dataclasses
import re

from jax.sharding import Mesh

from maxmoe.cluster import Cluster, gpu_target
from maxmoe.config import ConfigError
from maxmoe.plan.collectives import ROUNDS_LOOP, instruction_pricer
from maxmoe.plan.hlo import Instr, attr, callees, known_trip_count, operand_name, parse_module
from maxmoe.plan.op_cost import OpCost
from maxmoe.plan.roofline import kernel_efficiency
from maxmoe.plan.sites import by_site, site_lines

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute")
# no device time of their own: plumbing, and the halves handled at their start
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-start",
         "copy-done", "async-update", "domain"}
_SLICES = ("dynamic-slice", "slice", "gather")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_DIMS = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Rates:
    """What one device does per second: GEMM and attention FLOP/s (peak x kernel efficiency,
    roofline.kernel_efficiency), HBM and link bytes/s (one way)."""
    gemm_flops: float
    attention_flops: float
    hbm_bandwidth: float
    ici_bandwidth: float
    dcn_bandwidth: float


def cluster_rates(cluster: Cluster) -> Rates:
    """Rates of a cluster's device: its bf16 peak at the device file's bf16 GEMM and attention
    efficiencies (FP8 dots too: a floor), the HBM bandwidth its gpu_target's memory_bandwidth
    (configs/devices/KIND.yaml, XLA's own spec). ConfigError for a kind without a gpu_target."""
    target = gpu_target(cluster.kind)
    if target is None:
        raise ConfigError(f"--cluster {cluster.name}: kind {cluster.kind!r} has no gpu_target "
                          "(memory_bandwidth) in configs/devices/; the schedule cannot be timed")
    peak = cluster.peak_bf16_flops
    return Rates(peak * kernel_efficiency(cluster, "gemm_bf16")[0],
                 peak * kernel_efficiency(cluster, "attention")[0],
                 float(target["memory_bandwidth"]), cluster.ici_bandwidth, cluster.dcn_bandwidth)


@dataclasses.dataclass
class Collective:
    """One collective instruction of the schedule: bytes and time of one execution, how many
    times a step runs it, and the seconds of all of them left exposed."""
    name: str
    kind: str
    link: str  # "ici" or "dcn"
    op_name: str
    sync: bool
    bytes: float
    time_s: float
    times: float = 1.0
    exposed_s: float = 0.0

    def scaled(self, times: float) -> Collective:
        return dataclasses.replace(self, times=self.times * times,
                                   exposed_s=self.exposed_s * times)


@dataclasses.dataclass
class Run:
    """One execution of a computation: its compute's roofline seconds, those that hid no
    collective of its own (spare_s), and its collectives (loops inside multiplied)."""
    compute_s: float = 0.0
    spare_s: float = 0.0
    collectives: list[Collective] = dataclasses.field(default_factory=list)

    def cost(self) -> float:
        return self.compute_s + sum(c.exposed_s for c in self.collectives)


class _Timeline:
    """The collectives in flight in one computation's schedule, in start order (module
    docstring's rule): compute credits them in turn, a done serialises its link."""

    def __init__(self):
        self.flight: list[list] = []  # [Collective, seconds not yet hidden]
        self.spare = 0.0

    def compute(self, seconds: float) -> None:
        for entry in self.flight:
            take = min(entry[1], seconds)
            entry[1] -= take
            seconds -= take
        self.spare += seconds

    def start(self, c: Collective) -> None:
        self.flight.append([c, c.time_s])

    def done(self, c: Collective) -> None:
        i = next(k for k, e in enumerate(self.flight) if e[0] is c)
        for entry in self.flight[:i + 1]:
            if entry[0].link == c.link:
                entry[0].exposed_s += entry[1]
                entry[1] = 0.0
        del self.flight[i]

    def finish(self) -> list[Collective]:
        """Exposes what is still in flight at the computation's end; returns those."""
        left = [e[0] for e in self.flight]
        for c in left:
            self.done(c)
        return left


class _Schedule:
    """Times one compiled module's computations (module docstring)."""

    def __init__(self, comps: dict[str, list[Instr]], price, rates: Rates,
                 a2a_scale: dict[str, float]):
        self.comps, self.price, self.rates, self.a2a_scale = comps, price, rates, a2a_scale
        self.cost = OpCost(comps)
        self.warnings: list[str] = []
        self._runs: dict[str, Run] = {}
        self._defs: dict[str, dict[str, Instr]] = {}

    def op_seconds(self, ins: Instr) -> float:
        gemm, attention = self.cost.flops(ins)
        return max(gemm / self.rates.gemm_flops + attention / self.rates.attention_flops,
                   self.cost.hbm_bytes(ins) / self.rates.hbm_bandwidth)

    def collective(self, ins: Instr, comp: str) -> Collective | None:
        """The collective an instruction starts (or is, when synchronous); None otherwise."""
        target, where, sync = ins, comp, '"is_sync":true' in ins.attrs
        if ins.opcode == "async-start":
            body = self.comps.get(next(iter(callees(ins)), ""), [])
            target = next((i for i in body if i.root), None)
            where = next(iter(callees(ins)), "")
            if target is None or target.opcode not in COLLECTIVES:
                return None
        elif ins.opcode in COLLECTIVES:
            sync = True
        elif not (ins.opcode.endswith("-start")
                  and ins.opcode.removesuffix("-start") in COLLECTIVES):
            return None
        sent = self.price(target, where)
        ici = dcn = 0.0
        for (label, kind), (i, d) in sent.items():  # the expert all-to-all as the plan prices it
            expert = kind == "all-to-all" and "expert" in label.split("+")
            ici += i * (self.a2a_scale.get("ici", 1.0) if expert else 1.0)
            dcn += d * (self.a2a_scale.get("dcn", 1.0) if expert else 1.0)
        if ici + dcn <= 0:
            return None
        m = _OP_NAME.search(target.attrs) or _OP_NAME.search(ins.attrs)
        kind = "+".join(sorted({k for _, k in sent}))
        seconds = ici / self.rates.ici_bandwidth + dcn / self.rates.dcn_bandwidth
        return Collective(ins.name, kind, "dcn" if dcn > 0 else "ici",
                          m.group(1) if m else self.sent_op_name(ins, comp), sync, ici + dcn,
                          seconds)

    def sent_op_name(self, ins: Instr, comp: str) -> str:
        """The op_name of what a collective without one sends (XLA keeps none on the async
        ragged all-to-alls): the first producer up its first operands that has one, else ""."""
        defs = self._defs.setdefault(comp, {i.name: i for i in self.comps.get(comp, [])})
        seen = set()
        while ins.operands and ins.name not in seen:
            seen.add(ins.name)
            ins = defs.get(operand_name(ins.operands[0]))
            if ins is None:
                return ""
            if m := _OP_NAME.search(ins.attrs):
                return m.group(1)
        return ""

    def loop_times(self, ins: Instr, body: Run) -> float:
        """How many times a while's body counts (collectives.py's rule)."""
        trip = known_trip_count(ins)
        if trip is None:
            if body.collectives:
                self.warnings.append(f"while {ins.name}: no known trip count, counted once")
            return 1.0
        return 1.0 if ROUNDS_LOOP.search(ins.attrs) else float(trip)

    def called(self, ins: Instr) -> tuple[Run, float] | None:
        """(run, times) of a while, conditional or call; None for any other op."""
        if ins.opcode == "while":
            name = (attr(ins.attrs, "body") or "").lstrip("%")
            body = self.run(name) if name in self.comps else Run()
            return body, self.loop_times(ins, body)
        if ins.opcode not in ("conditional", "call"):
            return None
        subs = [self.run(c) for c in callees(ins) if c in self.comps]
        return max(subs, key=Run.cost, default=Run()), 1.0  # a call has one

    def run(self, comp: str) -> Run:
        """One execution of computation `comp` (memoised)."""
        if comp in self._runs:
            return self._runs[comp]
        out, line, started = Run(), _Timeline(), {}
        for ins in self.comps[comp]:
            if ins.opcode in _FREE:
                if ins.opcode == "async-update" and operand_name(ins.operands[0]) in started:
                    started[ins.name] = started[operand_name(ins.operands[0])]
                continue
            if (c := self.collective(ins, comp)) is not None:
                out.collectives.append(c)
                line.start(c)
                if c.sync:
                    line.done(c)
                else:
                    started[ins.name] = c
                continue
            if ins.opcode.endswith("-done"):
                if (c := started.pop(operand_name(ins.operands[0]), None)) is not None:
                    line.done(c)
                continue
            sub = self.called(ins)
            if sub is not None:
                run, times = sub
                out.compute_s += times * run.compute_s
                out.collectives += [c.scaled(times) for c in run.collectives]
                line.compute(times * run.spare_s)
                continue
            seconds = self.op_seconds(ins)
            out.compute_s += seconds
            line.compute(seconds)
        for c in line.finish():
            self.warnings.append(f"{c.name}: started in {comp} without a done there; exposed at "
                                 "its end")
        out.spare_s = line.spare
        self._runs[comp] = out
        return out


@dataclasses.dataclass(frozen=True)
class Overlap:
    """A step's collectives timed against its schedule: all their roofline seconds, those left
    exposed, the schedule's compute seconds, each collective, and what could not be counted."""
    communication_s: float
    exposed_s: float
    compute_s: float
    collectives: list[Collective]
    uncounted_custom_calls: dict[str, int]
    warnings: list[str]

    def to_json(self, top: int = 5) -> dict:
        """The plan's "overlap" object: totals, the `top` most exposed collectives, every
        synchronous one (kind, bytes per step, op_name), and every collective's exposed and
        total seconds grouped by kind x link x site (plan/sites.py, "by_site")."""
        row = lambda c: {"name": c.name, "kind": c.kind, "link": c.link,  # noqa: E731
                         "op_name": c.op_name, "times": c.times, "bytes": c.bytes * c.times,
                         "seconds": c.time_s * c.times, "exposed_s": c.exposed_s}
        ranked = sorted(self.collectives, key=lambda c: -c.exposed_s)
        return {"source": "schedule", "communication_s": self.communication_s,
                "exposed_communication_s": self.exposed_s,
                "schedule_compute_s": self.compute_s,
                "async_collectives": sum(not c.sync for c in self.collectives),
                "top_exposed": [row(c) for c in ranked[:top] if c.exposed_s > 0],
                "synchronous": [row(c) for c in ranked if c.sync],
                "by_site": by_site(self.collectives),
                "uncounted_custom_calls": self.uncounted_custom_calls,
                "warnings": self.warnings}


def schedule_overlap(hlo_text: str, mesh: Mesh, devices_per_host: int, rates: Rates,
                     a2a_scale: dict[str, float] | None = None) -> Overlap:
    """The module docstring's exposed communication of one step, from its scheduled HLO text on
    `mesh` (partition i is mesh.devices.flat[i]; a device's host is its id // devices_per_host).
    a2a_scale: {"ici": f, "dcn": f}, the expert axis's all-to-all bytes times f on each link
    (the plan prices it at balanced routed bytes, not the compiled buffers: report.py)."""
    if "is_scheduled=true" not in hlo_text.split("\n", 1)[0]:
        raise ValueError("schedule_overlap needs a scheduled HLO module (is_scheduled=true)")
    comps, entry = parse_module(hlo_text)
    schedule = _Schedule(comps, instruction_pricer(comps, mesh, devices_per_host), rates,
                         a2a_scale or {})
    run = schedule.run(entry)
    uncounted: dict[str, int] = {}
    for target in schedule.cost.uncounted.values():
        uncounted[target] = uncounted.get(target, 0) + 1
    return Overlap(sum(c.time_s * c.times for c in run.collectives),
                   sum(c.exposed_s for c in run.collectives), run.compute_s, run.collectives,
                   dict(sorted(uncounted.items())), schedule.warnings)


def _short(row: dict) -> str:
    """A collective's op_name without the step's and loops' scopes, at most 70 characters."""
    name = re.sub(r"jit\(train_step\)/|while/body/|eval_jaxpr/", "", row["op_name"])
    return (name if len(name) <= 70 else "..." + name[-67:]) or row["name"]


def overlap_line(overlap: dict | None) -> str:
    """`maxmoe plan`'s overlap line: where the exposed time comes from, the most exposed
    collectives, the most exposed sites (plan/sites.py) and the synchronous ones."""
    if not overlap:
        return ("overlap: assumed (roofline.COMM_OVERLAP of the communication hidden, at most "
                "the compute; read from the schedule only under --compiler gpu)")
    text = (f"overlap read from XLA:GPU's schedule: {overlap['exposed_communication_s']:.3g} s "
            f"of {overlap['communication_s']:.3g} s communication exposed "
            f"({overlap['async_collectives']} async collectives)")
    top = "; ".join(f"{c['kind']} {c['exposed_s']:.3g} of {c['seconds']:.3g} s ({c['link']}, "
                    f"x{c['times']:g}, {_short(c)})" for c in overlap["top_exposed"][:3])
    sync = overlap["synchronous"]
    lines = [text, "most exposed: " + (top or "none")]
    lines += ["exposed by site: " + line for line in site_lines(overlap.get("by_site", []))]
    lines.append(f"synchronous (fully exposed): {len(sync)}" + (": " + "; ".join(
        f"{c['kind']} {c['bytes'] / 1e9:.3g} GB x{c['times']:g} ({_short(c)})" for c in sync[:4])
        if sync else ""))
    if overlap["uncounted_custom_calls"]:
        lines.append("custom calls timed by their bytes only (a lower bound): "
                     + ", ".join(f"{n} {t}" for t, n in overlap["uncounted_custom_calls"].items()))
    return "\n    ".join(lines)
