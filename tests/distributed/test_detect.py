"""Who is who in a multi-host job: explicit settings, SLURM, Open MPI and Kubernetes (no cluster
needed: `detect` reads a given environment)."""

import pytest

from maxmoe.config import ConfigError, DistributedConfig
from maxmoe.distributed import Membership, detect, first_host

NONE = DistributedConfig()


def test_single_process_joins_nothing():
    assert detect(NONE, {}) is None
    assert detect(NONE, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
                         "SLURM_JOB_NODELIST": "n1"}) is None  # interactive allocation
    assert detect(NONE, {"MAXMOE_NO_DISTRIBUTED": "1", "OMPI_COMM_WORLD_SIZE": "4"}) is None


def test_explicit_settings_win():
    """MAXMOE_* variables override what SLURM says (and the source names both), and
    distributed.* config settings override the environment."""
    env = {"MAXMOE_COORDINATOR": "10.0.0.1:1234", "MAXMOE_NUM_PROCESSES": "4",
           "MAXMOE_PROCESS_ID": "3", "SLURM_JOB_ID": "7", "SLURM_NTASKS": "2",
           "SLURM_PROCID": "1", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert detect(NONE, env) == Membership("10.0.0.1:1234", 4, 3, "SLURM + MAXMOE_COORDINATOR + "
                                           "MAXMOE_NUM_PROCESSES + MAXMOE_PROCESS_ID")
    cfg = DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=1)
    assert detect(cfg, {}).coordinator_address == "h:1"
    assert detect(cfg, {"MAXMOE_PROCESS_ID": "0"}).process_id == 1


def test_slurm_open_mpi_kubernetes():
    """Membership (coordinator, process count, process id, source) read from SLURM (first host
    of a bracketed nodelist, port from the job id), Open MPI (first address of the HNP URI, port
    from its job id), a Kubernetes JobSet (pod 0's DNS name) and an indexed Job
    (JOB_COMPLETION_INDEX)."""
    slurm = {"SLURM_JOB_ID": "4100", "SLURM_NTASKS": "16", "SLURM_PROCID": "5",
             "SLURM_JOB_NODELIST": "gpu[007-010,12],cpu1"}
    assert detect(NONE, slurm) == Membership(f"gpu007:{61440 + 4100 % 4096}", 16, 5, "SLURM")
    ompi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
            "OMPI_MCA_orte_hnp_uri": "1234.0;tcp://10.1.2.3,172.17.0.1:4567"}
    assert detect(NONE, ompi) == Membership(f"10.1.2.3:{61440 + 1234}", 2, 1, "Open MPI")
    jobset = {"JOBSET_NAME": "maxmoe", "REPLICATED_JOB_NAME": "workers", "JOB_INDEX": "0",
              "JOB_COMPLETION_INDEX": "3", "MAXMOE_NUM_PROCESSES": "4"}
    assert detect(NONE, jobset) == Membership(
        "maxmoe-workers-0-0.maxmoe:55527", 4, 3, "Kubernetes JobSet + MAXMOE_NUM_PROCESSES")
    indexed = {"JOB_COMPLETION_INDEX": "1", "MAXMOE_NUM_PROCESSES": "2",
               "MAXMOE_COORDINATOR": "train-0.svc:8476"}
    assert detect(NONE, indexed).process_id == 1
    assert first_host("a,b") == "a" and first_host("x[3]") == "x3"


@pytest.mark.parametrize("env, message", [
    ({"JOB_COMPLETION_INDEX": "1", "JOBSET_NAME": "j"}, "process count is unknown"),
    ({"JOB_COMPLETION_INDEX": "1", "MAXMOE_NUM_PROCESSES": "2"}, "coordinator address is unknown"),
    ({"MAXMOE_COORDINATOR": "h:1", "MAXMOE_NUM_PROCESSES": "2", "MAXMOE_PROCESS_ID": "2"},
     r"process id 2 is not in \[0, 2\)"),
    ({"OMPI_COMM_WORLD_SIZE": "x"}, "OMPI_COMM_WORLD_SIZE='x': not an integer"),
])
def test_incomplete_environment_is_a_clear_error(env, message):
    with pytest.raises(ConfigError, match=message):
        detect(NONE, env)
