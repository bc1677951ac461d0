"""The layouts `maxmoe plan --search` considers, ranked by the pre-ranker's analytic estimate
(plan/prerank.py) so only the promising ones are compiled.

Every candidate passes `validate` for the cluster's devices and hosts.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator

from maxmoe.cluster import Cluster
from maxmoe.config import MESH_AXES, Config, ConfigError
from maxmoe.model.spec import layer_groups
from maxmoe.parallel.schedule import pipeline_schedule
from maxmoe.plan.estimate import state_bytes
from maxmoe.plan.prerank import Estimate, Layout, estimate
from maxmoe.validation import validate

# host split orders: which axes fill a host first (tensor must stay inside one)
HOST_ORDERS = (("tensor", "expert", "fsdp", "pipeline", "data"),
               ("tensor", "fsdp", "expert", "pipeline", "data"))
REMAT_POLICIES = ("full", "save_named")
MICROBATCHES = (1, 2, 4, 8)
WEIGHTS = ("zero3", "zero1")  # mesh.weights; hsdp equals zero1 where no data axis stays in a host
MAX_PIPELINE = 16


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def host_split(sizes: dict[str, int], per_host: int, order: tuple[str, ...]) -> dict[str, int] | None:
    """DCN factor per axis when a host's devices are filled in `order`; None when they cannot
    be (the axes do not factor the host) or tensor would cross hosts."""
    left, ici = per_host, {}
    for axis in order:
        ici[axis] = math.gcd(sizes[axis], left)
        left //= ici[axis]
    if left != 1 or ici["tensor"] != sizes["tensor"]:
        return None
    return {a: sizes[a] // ici[a] for a in MESH_AXES}


def pipeline_sizes(cfg: Config, devices: int) -> list[int]:
    """1 and every stage count up to MAX_PIPELINE that pipelines some run of layers."""
    groups = [n for _, _, n in layer_groups(cfg.model)]
    return [p for p in divisors(devices) if p == 1 or (
        p <= MAX_PIPELINE and any(pipeline_schedule(cfg.model, p).pipelines(n) for n in groups))]


def meshes(cfg: Config, devices: int, per_host: int) -> Iterator[dict[str, int]]:
    """Mesh sizes whose model dimensions divide: tensor inside a host and dividing the heads,
    expert dividing the experts; data takes what the others leave."""
    a, e = cfg.attention, cfg.moe
    for tensor in divisors(per_host):
        if a.num_heads % tensor or a.num_kv_heads % tensor:
            continue
        for expert in divisors(math.gcd(e.num_experts, devices // tensor)):
            for pipeline in pipeline_sizes(cfg, devices // (tensor * expert)):
                rest = devices // (tensor * expert * pipeline)
                for fsdp in divisors(rest):
                    yield {"data": rest // fsdp, "fsdp": fsdp, "pipeline": pipeline,
                           "expert": expert, "tensor": tensor}


def group_limited_ok(cfg: Config, dcn: dict[str, int]) -> bool:
    """Group-limited routing (DeepSeek's node-limited routing) sends a token to at most
    groups_per_token groups: the expert axis may span at most num_groups hosts."""
    e = cfg.moe
    return e.groups_per_token >= e.num_groups or dcn["expert"] <= e.num_groups


def layouts(cfg: Config, origins: dict[str, str], cluster: Cluster) -> list[Layout]:
    """Every layout of cfg on the cluster that passes validation."""
    out, seen = [], set()
    for sizes in meshes(cfg, cluster.devices, cluster.devices_per_host):
        for order in HOST_ORDERS:
            dcn = host_split(sizes, cluster.devices_per_host, order)
            if dcn is None or not group_limited_ok(cfg, dcn):
                continue
            for remat, micro, weights in itertools.product(REMAT_POLICIES, MICROBATCHES,
                                                           WEIGHTS):
                layout = Layout(sizes, dcn, remat, micro, weights)
                if str(layout) in seen:
                    continue
                seen.add(str(layout))
                try:
                    validate(layout.apply(cfg), cluster.devices, origins, cluster.hosts)
                except ConfigError:
                    continue
                out.append(layout)
    return out


@dataclasses.dataclass(frozen=True)
class Ranking:
    all: list[Estimate]  # every valid layout, estimated
    fitting: list[Estimate]  # those estimated to fit, fastest first

    def to_compile(self, n: int) -> list[Estimate]:
        """The n layouts to compile: the best of each kind of layout first (pipelined or not,
        then each expert-axis size), then the rest by rank, so one family the estimate
        misjudges cannot take every compile."""
        chosen: list[Estimate] = []
        for family in (lambda e: e.layout.sizes["pipeline"] > 1,
                       lambda e: e.layout.sizes["expert"]):
            seen = set()
            for e in self.fitting:
                if family(e) not in seen:
                    seen.add(family(e))
                    if e not in chosen:
                        chosen.append(e)
        picked = chosen[:n]
        picked += [e for e in self.fitting if e not in picked][:n - len(picked)]
        return sorted(picked, key=self.fitting.index)

    def ignoring_memory(self) -> Ranking:
        """The same layouts with every one treated as fitting, fastest first: the planner's
        answer to "what would the step cost if memory were no object"."""
        return Ranking(self.all, sorted(self.all, key=lambda e: (e.step_s, e.peak)))


def ranked(cfg: Config, origins: dict[str, str], cluster: Cluster) -> Ranking:
    """Every valid layout estimated; the fitting ones ordered by estimated step time, then
    peak. State bytes are computed once per distinct mesh."""
    states: dict[tuple, object] = {}
    out = []
    for layout in layouts(cfg, origins, cluster):
        key = tuple(layout.sizes.values())
        if key not in states:
            states[key] = state_bytes(cfg, layout.sizes)
        out.append(estimate(cfg, layout, cluster, states[key]))
    fitting = sorted((e for e in out if e.fits), key=lambda e: (e.step_s, e.peak))
    return Ranking(out, fitting)
