"""Joins the processes of a multi-host job with `jax.distributed.initialize`.

One process per host; every process runs the same command. Who is who comes from, in order:

1. the config (`distributed.coordinator_address`, `.num_processes`, `.process_id`), then the
   environment variables MAXMOE_COORDINATOR, MAXMOE_NUM_PROCESSES, MAXMOE_PROCESS_ID
   (explicit: `launch/local_multiprocess.sh`, ssh, anything);
2. SLURM (`srun`: SLURM_NTASKS, SLURM_PROCID, SLURM_JOB_NODELIST, SLURM_JOB_ID);
3. Open MPI (`mpirun`: OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_RANK, OMPI_MCA_orte_hnp_uri);
4. Kubernetes indexed Job / JobSet (JOB_COMPLETION_INDEX, JOBSET_NAME, REPLICATED_JOB_NAME,
   JOB_INDEX; the process count from MAXMOE_NUM_PROCESSES, which the manifest sets).

Anything explicit fills the gaps of a detected environment (e.g. MAXMOE_COORDINATOR under
SLURM). MAXMOE_COORDINATOR_PORT picks the port where only a host is known. One process (or
MAXMOE_NO_DISTRIBUTED=1) does nothing.

Failure is bounded: a process that stops sending heartbeats for `heartbeat_timeout_s` is
declared dead and JAX aborts every other process (exit code 134 after "Terminating process
because the JAX distributed service detected fatal errors"), so the scheduler sees a failed
job and restarts it; the same command then resumes from the newest checkpoint. JAX takes the
timeout once, at `jax.distributed.initialize` (the coordination service and every client;
jax 0.10.2 offers no way to change it later), so it also covers start-up. XLA's coordination
agent sends a heartbeat every timeout/2, each with a timeout/2 deadline: keep the timeout well
above the stalls of a busy host (the tests use 30 s, the default is 100 s).

On CPU, collectives go through Gloo, which gives the processes 30 s (fixed; not a setting in
jax 0.10.2) to meet at the first collective of each device group. A process that compiles
the first step more than 30 s later than another (a loaded host) fails that rendezvous
("Gloo context initialization failed: DEADLINE_EXCEEDED"), and the job aborts. The train
loop therefore compiles its first step, then waits at `wait_for_processes` (the coordination
service's barrier, which has its own timeout) before running it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping

from maxmoe.config import ConfigError, DistributedConfig

DEFAULT_PORT = 55527  # coordinator port where the environment names only a host


@dataclasses.dataclass(frozen=True)
class Membership:
    """This process's place in the job, and where that was read from."""
    coordinator_address: str  # host:port of process 0
    num_processes: int
    process_id: int
    source: str  # e.g. "SLURM", "config", "MAXMOE_* environment"


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ConfigError(f"SLURM node list {nodelist!r}: cannot read its first host; set "
                          "MAXMOE_COORDINATOR=host:port in the job script")
    prefix, ranges = match.groups()
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def _port(env: Mapping[str, str], default: int = DEFAULT_PORT) -> str:
    return env.get("MAXMOE_COORDINATOR_PORT", str(default))


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise ConfigError(f"environment variable {key}={env[key]!r}: not an integer; fix the "
                          "launch script") from None


def _from_cluster(env: Mapping[str, str]) -> tuple[str, str | None, int | None, int | None]:
    """(source, coordinator, num_processes, process_id) read from a scheduler's variables."""
    if "SLURM_JOB_ID" in env and ("SLURM_NTASKS" in env or "SLURM_NPROCS" in env):
        count = _int(env, "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS")
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get(
            "SLURM_NODELIST")
        # same port rule as JAX's own SLURM support: derived from the job id
        port = _port(env, 61440 + _int(env, "SLURM_JOB_ID") % 4096)
        coordinator = f"{first_host(nodes)}:{port}" if nodes else None
        return "SLURM", coordinator, count, _int(env, "SLURM_PROCID") if "SLURM_PROCID" in env else None
    if "OMPI_COMM_WORLD_SIZE" in env:
        coordinator = None
        uri = env.get("OMPI_MCA_orte_hnp_uri", "")
        host = re.search(r"tcp://([^,:;/]+)", uri)
        if host:  # '<jobid>.0;tcp://10.0.0.1,...:port': JAX's rule, port from the job id
            job = uri.split(".", 1)[0]
            port = _port(env, 61440 + int(job) % 4096 if job.isdigit() else DEFAULT_PORT)
            coordinator = f"{host.group(1)}:{port}"
        return ("Open MPI", coordinator, _int(env, "OMPI_COMM_WORLD_SIZE"),
                _int(env, "OMPI_COMM_WORLD_RANK") if "OMPI_COMM_WORLD_RANK" in env else None)
    if "JOB_COMPLETION_INDEX" in env:
        index = _int(env, "JOB_COMPLETION_INDEX")
        coordinator = None
        if "JOBSET_NAME" in env:
            jobset, replicated = env["JOBSET_NAME"], env.get("REPLICATED_JOB_NAME", "")
            job_index = _int(env, "JOB_INDEX") if env.get("JOB_INDEX") else 0
            if job_index:  # several Jobs of one replicatedJob: index pods across them
                if "MAXMOE_PROCESSES_PER_JOB" not in env:
                    raise ConfigError(f"JobSet job index {job_index}: set MAXMOE_PROCESSES_PER_JOB "
                                      "(the parallelism of one Job) in the manifest")
                index += job_index * _int(env, "MAXMOE_PROCESSES_PER_JOB")
            # pod 0 of job 0; JobSet's headless service is named after the JobSet
            coordinator = f"{jobset}-{replicated}-0-0.{jobset}:{_port(env)}"
            return "Kubernetes JobSet", coordinator, None, index
        return "Kubernetes indexed Job", coordinator, None, index
    return "", None, None, None


def detect(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> Membership | None:
    """Who this process is; None for a single-process run (nothing to join)."""
    env = os.environ if env is None else env
    if env.get("MAXMOE_NO_DISTRIBUTED") == "1":
        return None
    source, coordinator, count, index = _from_cluster(env)
    explicit = []
    if "MAXMOE_COORDINATOR" in env:
        coordinator = env["MAXMOE_COORDINATOR"]
        explicit.append("MAXMOE_COORDINATOR")
    if "MAXMOE_NUM_PROCESSES" in env:
        count = _int(env, "MAXMOE_NUM_PROCESSES")
        explicit.append("MAXMOE_NUM_PROCESSES")
    if "MAXMOE_PROCESS_ID" in env:
        index = _int(env, "MAXMOE_PROCESS_ID")
        explicit.append("MAXMOE_PROCESS_ID")
    if cfg.coordinator_address:
        coordinator = cfg.coordinator_address
        explicit.append("distributed.coordinator_address")
    if cfg.num_processes:
        count = cfg.num_processes
        explicit.append("distributed.num_processes")
    if cfg.process_id >= 0:
        index = cfg.process_id
        explicit.append("distributed.process_id")
    if not source and not explicit:
        return None
    where = " + ".join(([source] if source else []) + explicit)
    if count is None or count == 1 and coordinator is None:
        if count is None:
            raise ConfigError(f"{where}: the process count is unknown; set MAXMOE_NUM_PROCESSES "
                              "or distributed.num_processes")
        return None  # e.g. an interactive SLURM allocation with one task
    if count == 1:
        return None
    if coordinator is None:
        raise ConfigError(f"{where}: the coordinator address is unknown; set "
                          "MAXMOE_COORDINATOR=host:port (process 0's host) or "
                          "distributed.coordinator_address")
    if index is None or not 0 <= index < count:
        raise ConfigError(f"{where}: process id {index} is not in [0, {count}); set "
                          "MAXMOE_PROCESS_ID or distributed.process_id")
    return Membership(coordinator, count, index, where)


def initialize(cfg: DistributedConfig | None = None) -> Membership | None:
    """Joins the job (before any JAX computation); returns the membership, None if alone."""
    cfg = cfg or DistributedConfig()
    member = detect(cfg)
    if member is None:
        return None
    import jax  # late: commands/setup.py imports this module, and `maxmoe --help` loads no JAX

    jax.distributed.initialize(
        coordinator_address=member.coordinator_address,
        num_processes=member.num_processes,
        process_id=member.process_id,
        initialization_timeout=cfg.initialization_timeout_s,
        heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
        shutdown_timeout_seconds=cfg.shutdown_timeout_s,
    )
    if member.process_id == 0:
        # on stderr (logging is not configured): when a process dies, the survivors die in
        # C++ with JAX's message; this line says beforehand what that abort will mean
        print(f"maxmoe: joined {member.num_processes} processes via {member.source} "
              f"(coordinator {member.coordinator_address}); if one dies, the others abort "
              f"within about distributed.heartbeat_timeout_s={cfg.heartbeat_timeout_s} s "
              "(exit code 134; JAX names the lost process ids after 'stopped sending "
              "heartbeats', or says the leader task died if it was process 0)",
              file=sys.stderr, flush=True)
    return member


def wait_for_processes(name: str, timeout_s: float) -> None:
    """Returns once every process of the job has called it with the same `name` (a barrier of
    jax.distributed's coordination service, through Orbax's public wrapper: no device
    collective, so no Gloo/NCCL rendezvous deadline); at once in a one-process run."""
    import jax  # late, as in initialize
    import orbax.checkpoint as ocp

    if jax.process_count() > 1:
        ocp.multihost.get_barrier_sync_fn()(key=name, timeout_ms=int(timeout_s * 1000))
