"""kill -9 at random moments (one of them in the middle of an async save) and SIGTERM, then the
same `maxmoe train` command again: every start resumes from the last complete step, and the
final params equal an uninterrupted run's bit for bit.

Runs the real CLI in subprocesses on one CPU device with a persistent compilation cache, so
only the first run compiles.
"""

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from maxmoe.config import load_config
from maxmoe.validation import validate
from maxmoe.sharding import make_mesh
from maxmoe.train.checkpoint import Checkpointer
from maxmoe.train.step import make_trainer

TINY = ["model.vocab_size=512", "model.hidden_size=64", "model.num_layers=2",
        "model.num_dense_layers=1", "model.dense_mlp_size=128", "attention.num_heads=4",
        "attention.num_kv_heads=2", "attention.head_dim=16", "moe.num_experts=4",
        "moe.experts_per_token=2", "moe.expert_mlp_size=32", "moe.num_shared_experts=1",
        "data.seq_len=32", "data.global_batch_size=8", "precision.compute_dtype=float32",
        "optimizer.warmup_steps=2", "optimizer.decay_steps=20", "logging.every_steps=1",
        "logging.progress_bar=false", "mesh.cpu_devices=1", "mesh.data=1",
        "checkpoint.every_steps=2"]
STEPS = 14


class Run:
    """One `maxmoe train` subprocess whose stderr lines are collected as they arrive."""

    def __init__(self, run_dir: Path, env: dict):
        cmd = [sys.executable, "-m", "maxmoe.cli", "train", *TINY, f"train.steps={STEPS}",
               f"run.dir={run_dir}"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None:
                return  # finished (or crashed: the exit code is checked by the caller)
            assert time.monotonic() < deadline, f"no {text!r} in {timeout}s"
            time.sleep(0.01)

    def finish(self, timeout: float = 120) -> tuple[int, dict | None]:
        # not communicate(): it reads stderr too, taking lines from the reader thread and
        # closing the pipe under it. stdout holds only the summary line (fits a pipe's buffer)
        self.proc.wait(timeout=timeout)
        out = self.proc.stdout.read()
        self._reader.join(5)
        summary = json.loads(out.splitlines()[-1]) if out.strip() else None
        return self.proc.returncode, summary


def final_params(run_dir: Path):
    cfg, origins = load_config([], TINY + [f"train.steps={STEPS}"])
    sizes = validate(cfg, 1, origins)
    trainer = make_trainer(cfg, make_mesh(sizes, jax.devices()[:1]))
    with Checkpointer(run_dir / "checkpoints", cfg.checkpoint) as ckpt:
        assert ckpt.latest_step() == STEPS
        state, _ = ckpt.restore(trainer.abstract_state)
    return jax.device_get(state)


@pytest.mark.slow
def test_kill_and_sigterm_anywhere_then_resume_bit_identical(tmp_path):
    env = dict(os.environ, MAXMOE_CACHE=str(tmp_path / "cache"),
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("XLA_FLAGS", None)  # the CLI fakes its own devices (mesh.cpu_devices)
    code, straight = Run(tmp_path / "straight", env).finish(timeout=300)
    assert code == 0 and straight["final_step"] == STEPS

    chaos = tmp_path / "chaos"
    ckpt_dir = chaos / "checkpoints"
    seed = int(time.time())
    rng = random.Random(seed)
    print("chaos seed", seed)  # rerun with random.Random(seed) to replay the same attacks
    attacks = ["kill-during-training", "kill-mid-save", "sigterm", "kill-during-training"]
    resumed_from = []
    for attack in attacks + ["finish"]:
        run = Run(chaos, env)
        if attack == "finish":
            code, summary = run.finish()
            assert code == 0, "".join(run.lines[-30:])
            resumed_from.append(summary["start_step"])
            break
        run.wait_for("steps ")  # restored (or initialised) and about to train
        started = [ln for ln in run.lines if "steps " in ln][-1]
        started_at = int(started.split("steps ")[1].split(" ")[0])
        if attack == "kill-mid-save":  # the moment an async save is in flight
            while run.proc.poll() is None and not any(
                    "orbax-checkpoint-tmp" in p.name for p in ckpt_dir.glob("*")):
                time.sleep(0.001)
            run.proc.kill()
            assert any("orbax-checkpoint-tmp" in p.name for p in ckpt_dir.glob("*")) \
                or run.proc.wait() == 0
        elif attack == "sigterm":
            run.wait_for(f"step {rng.randint(min(started_at + 1, STEPS - 1), STEPS - 1)}:")
            run.proc.send_signal(signal.SIGTERM)
            code, summary = run.finish(timeout=60)
            if summary["final_step"] < STEPS:  # it stopped early: a clean, saved exit
                assert code == 75 and summary["preempted"]
                assert max(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) == \
                    summary["final_step"]
        else:  # after a random logged step, plus up to one step's time
            run.wait_for(f"step {rng.randint(min(started_at + 1, STEPS - 1), STEPS - 1)}:")
            time.sleep(rng.uniform(0.0, 0.05))
            run.proc.kill()
        run.proc.wait()
        resumed_from.append(started_at)
        if run.proc.returncode == 0:
            break  # the attack came too late: training had finished
    print("chaos resumed from steps", resumed_from)
    assert not [p for p in ckpt_dir.iterdir() if "tmp" in p.name]  # debris removed
    a, b = final_params(tmp_path / "straight"), final_params(chaos)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    # every step was logged, each once per run that reached it; the last run finished
    logged = [json.loads(line)["step"] for line in (chaos / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1] == STEPS and set(logged) == set(range(1, STEPS + 1))
