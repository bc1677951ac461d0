"""Joins the processes of a multi-host job with `jax.distributed.initialize`.

Explicit settings (MAXMOE_COORDINATOR, MAXMOE_NUM_PROCESSES, MAXMOE_PROCESS_ID) win; otherwise
JAX's own cluster detection covers SLURM, Open MPI and Kubernetes. A single process with none
of these does nothing.
"""

from __future__ import annotations

import os

import jax

_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JOBSET_NAME")


def initialize() -> None:
    coordinator = os.environ.get("MAXMOE_COORDINATOR")
    if coordinator:
        jax.distributed.initialize(coordinator_address=coordinator,
                                   num_processes=int(os.environ["MAXMOE_NUM_PROCESSES"]),
                                   process_id=int(os.environ["MAXMOE_PROCESS_ID"]))
    elif any(k in os.environ for k in _CLUSTER_ENV) and os.environ.get("MAXMOE_NO_DISTRIBUTED") != "1":
        jax.distributed.initialize()  # auto-detects the cluster environment
