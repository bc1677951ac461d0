"""datatrove executors for `maxmoe data prepare --executor local|ray|slurm`.

One function turns a stage (stages.py) into datatrove's LocalPipelineExecutor (its tasks in
a standard-library process pool when several run at once: TaskProcesses),
RayPipelineExecutor or SlurmPipelineExecutor; the pipelines are the same for all three, so
their outputs can be compared. Missing packages, an unreachable Ray cluster and a missing
`sbatch` are user errors (ConfigError: one line, exit 2).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import multiprocessing
import os
import shlex
import socket
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import dill
from datatrove.executor import LocalPipelineExecutor, slurm
from datatrove.executor.ray import RayPipelineExecutor
from datatrove.executor.slurm import SlurmPipelineExecutor

from maxmoe.config import ConfigError

EXECUTORS = ("local", "ray", "slurm")


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    executor: str = "local"  # local | ray | slurm: datatrove's executor of the same name
    workers: int = 0  # local: tasks run at once (0 = one per core); ray: at most this many
    ray_address: str = ""  # ray: a running cluster ("auto", "HOST:PORT"); "" = start one here
    memory_gb_per_task: float = 2.0  # ray and slurm: memory reserved for each task
    partition: str = ""  # slurm: the partition to submit to
    time: str = "24:00:00"  # slurm: time limit of each job array task
    dry_run: bool = False  # slurm: write the sbatch scripts under OUT/slurm, submit nothing

    def check(self) -> None:
        if self.executor not in EXECUTORS:
            raise ConfigError(f"option --executor {self.executor!r}: unknown; use one of "
                              f"{', '.join(EXECUTORS)}")
        if self.dry_run and self.executor != "slurm":
            raise ConfigError("option --dry-run: only with --executor slurm (it writes the "
                              "sbatch scripts without submitting them)")
        if self.executor == "slurm" and not self.partition:
            raise ConfigError("option --partition: required with --executor slurm; name the "
                              "partition to submit to, e.g. --partition cpu")
        if self.executor == "ray":
            _require("ray", "ray")


def _require(module: str, executor: str) -> None:
    try:
        missing = importlib.util.find_spec(module) is None
    except ValueError:  # a module set to None in sys.modules (how the tests hide one)
        missing = True
    if missing:
        raise ConfigError(f"option --executor {executor}: needs the package {module!r}, which "
                          f"is not installed; pip install 'maxmoe[{executor}]'")


def start_ray(options: LaunchOptions) -> None:
    """Connects to options.ray_address, or starts a local Ray instance (no-op when this
    process already called ray.init, as the tests do)."""
    import ray  # late: the [ray] extra, for --executor ray only

    if ray.is_initialized():
        return
    _check_reachable(options.ray_address)
    try:
        ray.init(address=options.ray_address or None, log_to_driver=False,
                 include_dashboard=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"option --ray-address {options.ray_address!r}: cannot connect to a "
                          f"Ray cluster there ({first}); start one with 'ray start --head' or "
                          "leave --ray-address out to run on this machine") from None


def _check_reachable(address: str) -> None:
    """A HOST:PORT that accepts no connection is an error now: ray.init would wait minutes."""
    if address in ("", "auto") or "://" in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError) as e:
        raise ConfigError(f"option --ray-address {address!r}: no Ray cluster answers there "
                          f"({e}); start one with 'ray start --head', pass its HOST:PORT, or "
                          "leave --ray-address out to run on this machine") from None


def executor_for(stage, logging_dir: Path, options: LaunchOptions, depends=None):
    """The datatrove executor that runs `stage` (stages.Stage) with its completions and
    stats under `logging_dir`; `depends`: the previous stage's executor (slurm only)."""
    if options.executor == "local":
        workers = min(stage.tasks, options.workers or _cores())
        if workers > 1:
            return TaskProcesses(stage, logging_dir, workers)
        return LocalPipelineExecutor(stage.pipeline, tasks=stage.tasks, workers=1,
                                     logging_dir=str(logging_dir))
    if options.executor == "ray":
        return RayPipelineExecutor(stage.pipeline, tasks=stage.tasks,
                                   workers=min(stage.tasks, options.workers or stage.tasks),
                                   logging_dir=str(logging_dir),
                                   mem_per_cpu_gb=options.memory_gb_per_task)
    return SlurmPipelineExecutor(
        stage.pipeline, tasks=stage.tasks, time=options.time, partition=options.partition,
        job_name=f"maxmoe-{stage.name}", logging_dir=str(logging_dir), depends=depends,
        mem_per_cpu_gb=math.ceil(options.memory_gb_per_task), requeue=True,
        # the jobs run in the interpreter that launched them (same venv on a shared disk)
        env_command=f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:$PATH")


class TaskProcesses:
    """The local executor with `workers` > 1: datatrove's LocalPipelineExecutor runs each
    incomplete task (its _run_for_rank, as datatrove's own Ray actors do) in a process of the
    standard library's pool. Why: datatrove's pool (the `multiprocess` package) waits forever
    for a task process killed outright (kill -9, the out-of-memory killer); this pool notices
    the death (BrokenProcessPool) and stops, leaving the unfinished tasks to
    get_incomplete_ranks. Not LocalPipelineExecutor.run per task: it starts a manager process
    that inherits the task process's exit pipe, so the pool would not see that process die."""

    def __init__(self, stage, logging_dir: Path, workers: int):
        self.workers = workers
        self.executor = LocalPipelineExecutor(stage.pipeline, tasks=stage.tasks, workers=1,
                                              logging_dir=str(logging_dir))

    def run(self) -> None:
        """Runs the incomplete tasks; a task's exception is raised once the others end."""
        self.executor.save_executor_as_json()
        payload = dill.dumps(self.executor)
        # spawn: the caller may hold JAX or grain threads, which fork would copy
        with ProcessPoolExecutor(self.workers,
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_run_rank, payload, rank)
                       for rank in self.get_incomplete_ranks()]
            errors = [future.exception() for future in futures]
        raised = [e for e in errors if e is not None and not isinstance(e, BrokenProcessPool)]
        if raised:
            raise raised[0]

    def get_incomplete_ranks(self) -> list[int]:
        return self.executor.get_incomplete_ranks()


def _run_rank(executor: bytes, rank: int) -> None:
    dill.loads(executor)._run_for_rank(rank)


def _cores() -> int:
    return max(1, len(os.sched_getaffinity(0)))


@contextmanager
def slurm_submission(out: Path, dry_run: bool):
    """Around the Slurm launches: with `dry_run`, datatrove's sbatch call is replaced by one
    that writes each script to OUT/slurm/NN-JOB.sbatch and its sbatch line (with the
    dependencies on the earlier jobs) to OUT/slurm/submit.sh, which submits them all later."""
    if not dry_run:
        try:
            yield
        except FileNotFoundError as e:
            raise ConfigError(f"option --executor slurm: cannot run sbatch ({e}); run on a "
                              "Slurm login node, or write the scripts with --dry-run") from None
        return
    folder = out / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["#!/bin/bash", "# written by maxmoe data prepare --dry-run: submits every stage",
             "set -euo pipefail"]

    def write_script(contents: str, _retriever, *args) -> str:
        number = len(lines) - 2
        # sbatch does not expand ${JOB_NN} inside a script: a dependency moves to the line
        kept = [line for line in contents.splitlines() if not line.startswith(_DEPENDENCY)]
        args += tuple(line.removeprefix("#SBATCH ") for line in contents.splitlines()
                      if line.startswith(_DEPENDENCY))
        path = folder / f"{number:02d}-{_job_name(contents)}.sbatch"
        path.write_text("\n".join(kept) + "\n")
        lines.append(f"JOB_{number:02d}=$(sbatch --parsable {' '.join(args)} "
                     f"{shlex.quote(str(path))} | cut -d';' -f1)")
        return f"${{JOB_{number:02d}}}"

    with mock.patch.object(slurm, "launch_slurm_job", write_script):
        yield
    (folder / "submit.sh").write_text("\n".join(lines) + "\n")
    (folder / "submit.sh").chmod(0o755)


_DEPENDENCY = "#SBATCH --dependency="


def _job_name(contents: str) -> str:
    for line in contents.splitlines():
        if line.startswith("#SBATCH --job-name="):
            suffix = "-stats" if "merge_stats" in contents else ""
            return line.split("=", 1)[1] + suffix
    return "job"
