"""The plan's figures of a train step compiled on the devices a job runs on: what
`maxmoe train --dry-run` prints before a run, and `maxmoe train` writes to <run.dir>/plan.json.

The cluster is the one present: jax.devices()[0].device_kind names a configs/devices/KIND.yaml
(DEVICE_KINDS, or a file named after the kind's slug), with the job's device and per-host
counts. A kind with no file still gets the memory figures, judged against the device's own
allocator limit; its time and cost figures are None and the printout says how to add the file.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import TextIO

import jax

from maxmoe.bench import memory_line
from maxmoe.cluster import Cluster, device_kind, kind_slug, load_cluster, load_device_kind
from maxmoe.config import Config
from maxmoe.plan.planner import describe
from maxmoe.plan.probe import abstract_batch, compiled_figures, overlap_figures
from maxmoe.plan.report import GIB, plan_figures
from maxmoe.sharding import use_mesh
from maxmoe.train.setup import RunSetup, prepare_run


def live_cluster(spec: str = "") -> Cluster | None:
    """The cluster of this job's devices: --cluster `spec`'s figures if given, else the device
    kind's file; devices = jax.device_count(), devices_per_host = jax.local_device_count().
    None when the kind has no file. Raises ConfigError for a bad `spec`."""
    count, per_host = jax.device_count(), jax.local_device_count()
    if spec:
        base = load_cluster(spec)
        return dataclasses.replace(base, name=f"{count}x{base.kind}", devices=count,
                                   devices_per_host=per_host)
    _, name = device_kind()
    if name is None:
        return None
    fields, path = load_device_kind(name)
    fields["devices_per_host"] = per_host
    return Cluster(name=f"{count}x{name}", devices=count, origin=str(path), **fields)


def allocator_limit() -> int | None:
    """The first device's allocator limit in bytes (memory_stats' bytes_limit), if it has one."""
    return (jax.devices()[0].memory_stats() or {}).get("bytes_limit")


def memory_only_figures(measured: dict) -> dict:
    """The contract's keys for a device kind with no file: memory against the allocator's limit,
    time and cost None."""
    memory, limit = measured["memory"], allocator_limit()
    comm = measured["collectives"]
    return {
        "cluster": None, "mesh": measured["mesh"], "devices": measured["devices"],
        "peak_bytes_per_device": memory["peak_bytes"],
        "argument_bytes_per_device": memory["argument_bytes"],
        "device_memory_bytes": limit, "usable_bytes_per_device": limit,
        "fits": None if limit is None else memory["peak_bytes"] <= limit,
        "replicated_state_bytes_per_device": measured["replicated_state_bytes"],
        "replicated_leaves": measured["replicated"],
        "largest_buffers": measured["largest_buffers"],
        "collective_bytes_per_step": comm,
        "step_time_s": None, "tokens_per_second": None, "mfu": None,
        "device_hours_per_trillion_tokens": None, "cost_usd": None,
    }


def on_gpus(mesh) -> bool:
    """Whether `mesh`'s devices are GPUs (real, or the deviceless compile's), whose compiled
    schedule the overlap is read from (plan/overlap.py); elsewhere the plan assumes it."""
    return mesh.devices.flat[0].platform in ("gpu", "cuda")


def live_figures(setup: RunSetup, compiled, cluster: Cluster | None, compile_s: float) -> dict:
    """The plan's figures (report.plan_figures' keys, for train.steps) of the step compiled on
    this job's devices, plus "memory" (XLA's analysis) and "device_kind". On GPUs with a
    cluster to price, the exposed communication is read from the compiled schedule
    (overlap_source "schedule"), as `maxmoe plan --compiler gpu` reads it."""
    hlo = compiled.as_text()
    measured = compiled_figures(setup, compiled, jax.local_device_count(), hlo)
    measured["compile_s"] = round(compile_s, 1)
    if cluster is None:
        figures = memory_only_figures(measured)
    else:
        if on_gpus(setup.trainer.mesh):  # XLA:GPU's schedule says what overlaps: not assumed
            measured["overlap"] = overlap_figures(hlo, setup.trainer.mesh,
                                                  cluster.devices_per_host, cluster, measured,
                                                  None)
        figures = plan_figures(measured, cluster, steps=setup.cfg.train.steps)
    figures.update(remat=measured["remat"], microbatches=measured["microbatches"],
                   memory=measured["memory"], device_kind=device_kind()[0])
    return figures


def write_plan(path: Path, setup: RunSetup, compiled, cluster: Cluster | None,
               compile_s: float) -> float:
    """Writes live_figures as JSON to `path` (<run.dir>/plan.json); returns the seconds the
    figures took (the compiled HLO's parse), which the run's compile time does not include."""
    t = time.perf_counter()
    figures = live_figures(setup, compiled, cluster, compile_s)
    path.write_text(json.dumps(figures, indent=1) + "\n")
    return time.perf_counter() - t


def plan_writer(cluster: Cluster | None):
    """The training loop's first_compiled hook: writes <run_dir>/plan.json (write_plan) priced
    on `cluster` (None: memory figures only); returns the seconds that took."""
    def write(setup: RunSetup, compiled, compile_s: float, run_dir: Path) -> float:
        return write_plan(run_dir / "plan.json", setup, compiled, cluster, compile_s)
    return write


def dry_run(cfg: Config, mesh_sizes: dict[str, int], cluster_spec: str, out: TextIO) -> int:
    """Compiles the first train step on every process's real devices from abstract arrays
    (allocates no state, reads no data, writes nothing) and prints (process 0) the memory line
    and the plan's figures. Returns 0 when the peak fits (or cannot be judged), 1 when not."""
    t0 = time.perf_counter()
    cluster = live_cluster(cluster_spec)  # a bad --cluster fails before the compile
    setup = prepare_run(cfg, mesh_sizes)
    trainer = setup.trainer
    batch = abstract_batch(cfg, trainer.batch_sharding)
    with use_mesh(trainer.mesh, trainer.rules):
        compiled = trainer.jitted_step.lower(trainer.abstract_state, batch).compile()
    compile_s = time.perf_counter() - t0
    if jax.process_index() != 0:  # every process compiles; process 0 reads and prints
        return 0
    figures = live_figures(setup, compiled, cluster, compile_s)
    figures["wall_s"] = round(time.perf_counter() - t0, 1)
    say = lambda text: print(text, file=out)  # noqa: E731
    say(f"maxmoe train --dry-run: {figures['devices']} x {figures['device_kind']} on "
        f"{jax.process_count()} process(es); nothing written to {cfg.run.dir}")
    say(memory_line(figures["memory"], cfg.precision.fp8))
    if cluster is not None:
        describe(figures, cluster, out, title="dry run")
    else:
        say(unknown_kind_line(figures))
    say(json.dumps({k: v for k, v in figures.items() if k != "memory"}))
    return 1 if figures["fits"] is False else 0


def unknown_kind_line(figures: dict) -> str:
    """What the dry run says of a device kind with no configs/devices/ file."""
    kind = figures["device_kind"]
    limit = figures["device_memory_bytes"]
    verdict = ("no allocator limit to judge the fit against" if limit is None else
               f"{'fits' if figures['fits'] else 'does NOT fit'} the allocator's "
               f"{limit / GIB:.1f} GiB")
    return (f"  {verdict}; step time and cost: device kind {kind!r} is unknown; add "
            f"configs/devices/{kind_slug(kind)}.yaml (copy configs/devices/h200.yaml and its "
            f"sources, with device_name: \"{kind}\") or pass --cluster COUNTxKIND of a known "
            "kind")
