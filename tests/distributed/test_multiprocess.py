"""Several local processes forming one JAX job (2 processes x 4 CPU devices on 127.0.0.1):

- SIGTERM to one of them (through launch/local_multiprocess.sh) makes both save the same step
  and exit with code 75, and that checkpoint restores in one process onto another mesh shape
  (1 x 8 devices, and 4 devices), exactly;
- kill -9 of one process, once both train, makes the other exit with JAX's error naming the
  lost process within distributed.heartbeat_timeout_s (plus slack) of the kill (no hang);
- 2 processes x 4 devices train to the same per-step losses as 1 process x 8 devices fed the
  same global batches (data.streams scaled inversely to the process count, see
  maxmoe/data/pipeline.py).
"""

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from maxmoe.config_files import load_config
from maxmoe.data.pipeline import make_dataset
from maxmoe.data.tokenizer import load_tokenizer
from maxmoe.sharding import make_mesh
from maxmoe.train.checkpoint import Checkpointer
from maxmoe.train.loop import train
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate
from tests.train.test_chaos import TINY

ROOT = Path(__file__).resolve().parents[2]
# JAX fixes the heartbeat timeout once, at jax.distributed.initialize, so it also covers
# start-up; heartbeats go every timeout/2 with that deadline: 30 s leaves a busy host room
# (see maxmoe/distributed.py). The kill -9 bound is measured from the kill.
HEARTBEAT_S = 30
START_S = 480  # until training: start-up and compilation take minutes on a busy host
MULTI = [t for t in TINY if not t.startswith("mesh.")] + [
    "mesh.cpu_devices=4", "mesh.data=2", "mesh.dcn_data=2", "mesh.fsdp=2", "mesh.expert=2",
    "checkpoint.every_steps=1000", "train.steps=1000",
    f"distributed.heartbeat_timeout_s={HEARTBEAT_S}"]


def restore_on(run_dir, num_devices, **mesh):
    cfg, origins = load_config([], [t for t in MULTI if not t.startswith("mesh.")] +
                               [f"mesh.{k}={v}" for k, v in mesh.items()])
    sizes = validate(cfg, num_devices, origins)
    trainer = make_trainer(cfg, make_mesh(sizes, jax.devices()[:num_devices]))
    with Checkpointer(run_dir / "checkpoints", cfg.checkpoint) as ckpt:
        state, step = ckpt.restore(trainer.abstract_state)
    return state, step


@pytest.mark.slow
def test_sigterm_to_one_process_saves_everywhere_and_restores_in_one(tmp_path):
    # the launcher starts the Python running this test, not whichever python3 is on PATH
    env = dict(os.environ, MAXMOE_CACHE=str(tmp_path / "cache"), PYTHON=sys.executable)
    env.pop("XLA_FLAGS", None)
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [str(ROOT / "launch" / "local_multiprocess.sh"), "2", "train", *MULTI, f"run.dir={run_dir}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + START_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.stdout.read()
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True)
    worker_1 = [int(p) for p in workers.stdout.split()
                if "MAXMOE_PROCESS_ID=1" in Path(f"/proc/{p}/environ").read_text().replace("\0", " ")]
    assert len(worker_1) == 1
    sent = time.monotonic()
    os.kill(worker_1[0], signal.SIGTERM)
    out, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 75, out[-3000:]
    assert time.monotonic() - sent < 60
    summaries = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(summaries) == 1 and summaries[0]["preempted"]  # only process 0 prints it
    for i in range(2):  # both saved and stopped (75), not just the one that got SIGTERM
        assert f"process {i} exited with code 75" in out, out[-3000:]
    step = summaries[0]["final_step"]

    on_8, step_8 = restore_on(run_dir, 8, data=1, fsdp=4, expert=2)  # another mesh, 1 process
    on_4, step_4 = restore_on(run_dir, 4, data=1, fsdp=2, expert=2)
    assert step_8 == step_4 == step
    for a, b in zip(jax.tree.leaves(jax.device_get(on_8)), jax.tree.leaves(jax.device_get(on_4)),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(on_8["step"]) == step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """`maxmoe VERB` (train by default) as process `index` of a job on 127.0.0.1; output lines
    collected with the time they arrived."""

    def __init__(self, index: int, count: int, port: int, items: list[str], env: dict,
                 verb: str = "train"):
        env = dict(env, MAXMOE_COORDINATOR=f"127.0.0.1:{port}", MAXMOE_NUM_PROCESSES=str(count),
                   MAXMOE_PROCESS_ID=str(index))
        self.proc = subprocess.Popen([sys.executable, "-m", "maxmoe.cli", verb, *items],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def text(self) -> str:
        self._reader.join(5)
        return "".join(line for _, line in self.lines if "[Gloo]" not in line)


def kill_left(processes: list[Process]) -> None:
    """Kills the processes still running: a test that failed or timed out leaves none behind."""
    for p in processes:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()


@pytest.mark.slow
def test_kill_9_of_one_process_ends_the_other_within_the_heartbeat_bound(tmp_path):
    env = dict(os.environ, MAXMOE_CACHE=str(tmp_path / "cache"))
    env.pop("XLA_FLAGS", None)  # each process fakes its own 4 devices (mesh.cpu_devices)
    items = MULTI + [f"run.dir={tmp_path / 'run'}"]
    port = free_port()
    survivor, victim = (Process(i, 2, port, items, env) for i in range(2))
    try:
        deadline = time.monotonic() + START_S
        while not any(line.startswith("step 1:") for _, line in survivor.lines):  # training
            assert survivor.proc.poll() is None and victim.proc.poll() is None, survivor.text()
            assert time.monotonic() < deadline, survivor.text()
            time.sleep(0.05)
        assert victim.proc.poll() is None
        victim.proc.kill()  # SIGKILL: no handler, no goodbye to the coordinator
        killed = time.monotonic()
        # silent from the kill on, the victim is declared dead at most HEARTBEAT_S later; the
        # slack covers the service's periodic check and the abort (TimeoutExpired: a hang)
        try:
            code = survivor.proc.wait(timeout=HEARTBEAT_S + 20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process 0 still running {HEARTBEAT_S + 20} s after the kill:\n"
                        + survivor.text()[-3000:])
        exited = time.monotonic() - killed
        assert victim.proc.wait() == -signal.SIGKILL
    finally:
        kill_left([survivor, victim])
    out = survivor.text()
    print(f"process 0 exited with code {code} {exited:.1f} s after kill -9 of process 1 "
          f"(heartbeat timeout {HEARTBEAT_S} s)")
    assert code in (-signal.SIGABRT, 134), out[-3000:]  # JAX aborts: a failed job, not a hang
    # said beforehand by maxmoe, then by JAX: which process was lost, and why
    assert f"distributed.heartbeat_timeout_s={HEARTBEAT_S} s" in out, out[-3000:]
    assert re.search(r"stopped sending heartbeats\):\s*1\s", out), out[-3000:]


STEPS = 4


@pytest.mark.slow
def test_two_processes_of_4_devices_train_like_one_of_8(tmp_path, monkeypatch):
    """Same global batches (global_batch_size 8 = 2 processes x 4 streams = 1 x 8 streams),
    same logical mesh (data 2, fsdp 2, expert 2): the same loss at every step."""
    monkeypatch.setenv("MAXMOE_CACHE", str(tmp_path / "cache"))
    common = [t for t in TINY if not t.startswith(("mesh.", "checkpoint."))] + [
        f"train.steps={STEPS}", "checkpoint.enabled=false", "mesh.data=2", "mesh.fsdp=2",
        "mesh.expert=2"]
    two = common + ["data.streams=4", "mesh.cpu_devices=4", "mesh.dcn_data=2",
                    f"distributed.heartbeat_timeout_s={HEARTBEAT_S}", f"run.dir={tmp_path / 'two'}"]
    one = common + ["data.streams=8", f"run.dir={tmp_path / 'one'}"]

    cfg_one, origins = load_config([], one)
    cfg_two, _ = load_config([], two)
    tokenizer = load_tokenizer(cfg_one.data, cfg_one.model.vocab_size)  # trained once, cached
    alone = list(itertools.islice(make_dataset(cfg_one.data, tokenizer), STEPS))
    shares = [list(itertools.islice(make_dataset(cfg_two.data, tokenizer, process_index=i,
                                                 process_count=2), STEPS)) for i in range(2)]
    for n in range(STEPS):  # the premise: the same global batches, row for row
        for key, rows in alone[n].items():
            np.testing.assert_array_equal(rows, np.concatenate([s[n][key] for s in shares]))

    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    port = free_port()
    processes = [Process(i, 2, port, two, env) for i in range(2)]
    try:
        # meanwhile, here: 1 process x 8 devices (tests/conftest.py fakes them)
        summary_one = train(cfg_one, validate(cfg_one, 8, origins))
        codes = [p.proc.wait(timeout=START_S) for p in processes]
    finally:
        kill_left(processes)
    assert codes == [0, 0], processes[0].text()[-3000:] + processes[1].text()[-3000:]
    assert summary_one["final_step"] == STEPS

    def losses(run):
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text()
                   .splitlines()]
        assert [r["step"] for r in records] == list(range(1, STEPS + 1))
        return np.array([r["loss"] for r in records])

    loss_one, loss_two = losses("one"), losses("two")
    records = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").open()]
    # every process's step time (the first record's window holds no step: None)
    assert [len(r["step_time_s_by_process"]) for r in records] == [2] * STEPS
    assert all(t > 0 for r in records[1:] for t in r["step_time_s_by_process"])
    assert "step_time_s_by_process" not in (tmp_path / "one" / "metrics.jsonl").read_text()
    print("losses 1 x 8:", loss_one.tolist(), "2 x 4:", loss_two.tolist(),
          "max relative difference", float(np.max(np.abs(loss_one / loss_two - 1))))
    np.testing.assert_allclose(loss_two, loss_one, rtol=1e-5, atol=0)
    assert len(set(loss_one.tolist())) == STEPS  # the params moved: later steps test the updates
    summaries = [line for line in processes[0].text().splitlines() + processes[1].text()
                 .splitlines() if line.startswith("{")]
    assert len(summaries) == 1  # only process 0 prints the summary
