"""Checksums in a 2-process job (2 x 4 CPU devices on 127.0.0.1): each process writes its own
checksum file for the shards it owns; a byte flipped in a chunk that only process 1 verifies is
reported by both processes with the same line, both quarantine the step and resume the previous
one; `maxmoe ckpt verify` in one process reads both files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from maxmoe.cli import main
from maxmoe.train import checksums
from tests.distributed.test_multiprocess import free_port
from tests.train.test_checksums import flip_byte

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import json, sys
from pathlib import Path
import jax
jax.config.update("jax_num_cpu_devices", 4)
port, pid, phase, directory = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from maxmoe.config import CheckpointConfig
from maxmoe.train.checkpoint import Checkpointer, abstract_like

mesh = jax.make_mesh((8,), ("a",), axis_types=(jax.sharding.AxisType.Auto,))
rows = NamedSharding(mesh, P("a"))
values = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)

def state(offset):
    w = jax.make_array_from_callback(values.shape, rows, lambda i: values[i] + offset)
    step = jax.make_array_from_callback((), NamedSharding(mesh, P()), lambda i: np.int32(offset))
    return {"w": w, "step": step}

with Checkpointer(directory, CheckpointConfig(every_steps=1)) as ckpt:
    if phase == "save":
        ckpt.save(1, state(0))
        ckpt.save(2, state(1))
    else:
        resumed = ckpt.resume(abstract_like(state(0)))
        w = np.asarray(jax.experimental.multihost_utils.process_allgather(
            resumed.state["w"], tiled=True))
        print(json.dumps({"step": resumed.step, "reasons": resumed.reasons,
                          "w_equal": bool((w == values).all())}))
"""


def run_both(phase: str, directory: Path) -> list[str]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(port), str(i), phase,
                               str(directory)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:  # a hang (processes that disagree wait in a collective) leaves no stray process
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    return [out for out, _ in outs]


@pytest.mark.slow
def test_two_processes_write_their_checksums_and_agree_on_a_flip_only_one_verifies(
        tmp_path, capsys):
    directory = tmp_path / "checkpoints"
    run_both("save", directory)
    sums = directory / "2" / checksums.ITEM
    assert sorted(p.name for p in sums.glob("*.json")) == ["process_0-of-2.json",
                                                         "process_1-of-2.json"]
    recorded = checksums.read(sums)
    assert len(recorded["w"]["chunks"]) == 8 and len(recorded["step"]["chunks"]) == 1

    # a chunk in process 1's share of the verify (every other chunk of the sorted list)
    chunks = sorted((n, tuple(map(tuple, r))) for n, e in recorded.items() for r, _ in e["chunks"])
    name, region = chunks[1::2][0]
    assert name == "w"
    flip_byte(directory / "2", "w", f"{region[0][0] // 8}.0")
    shares = [checksums.verify(directory / "2" / "state", recorded, i, 2)[0] for i in range(2)]
    assert shares[0] == [] and [m.region for m in shares[1]] == [region]

    assert main(["ckpt", "verify", str(directory / "2")]) == 1  # one process, both files
    assert f"array w chunk [{region[0][0]}:{region[0][1]}, 0:256]" in capsys.readouterr().out

    results = [json.loads(out.strip().splitlines()[-1]) for out in run_both("resume", directory)]
    assert results[0] == results[1], results  # the same step, reason and values everywhere
    assert results[0]["step"] == 1 and results[0]["w_equal"]
    [reason] = results[0]["reasons"]
    assert reason.startswith(f"ChecksumError: array w chunk [{region[0][0]}:{region[0][1]}, "
                             "0:256]: crc32c "), reason
    assert (tmp_path / "checkpoints.quarantine" / "2").is_dir()
