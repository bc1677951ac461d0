"""Attacks on `maxmoe train`, each asserted to have happened, with the same command run again
after each: kill -9 after a logged step, kill -9 while an async save is in flight (its Orbax
tmp directory exists at the kill), SIGTERM (a clean, saved exit 75 before the last step), and
kill -9 again. Every start resumes from the last committed step, and the final params equal an
uninterrupted run's bit for bit.

The attack points are drawn from a seeded random.Random: the seed is printed, fixed by default,
and MAXMOE_CHAOS_SEED=N replays or varies them. Runs the real CLI in subprocesses on one CPU
device with a persistent compilation cache, so only the first run compiles.
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

from maxmoe.config_files import load_config
from maxmoe.sharding import make_mesh
from maxmoe.train.checkpoint import Checkpointer
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate

TINY = ["model.vocab_size=512", "model.hidden_size=64", "model.num_layers=2",
        "model.num_dense_layers=1", "model.dense_mlp_size=128", "attention.num_heads=4",
        "attention.num_kv_heads=2", "attention.head_dim=16", "moe.num_experts=4",
        "moe.experts_per_token=2", "moe.expert_mlp_size=32", "moe.num_shared_experts=1",
        "data.seq_len=32", "data.global_batch_size=8", "precision.compute_dtype=float32",
        "optimizer.warmup_steps=2", "optimizer.decay_steps=20", "logging.every_steps=1",
        "logging.progress_bar=false", "mesh.cpu_devices=1", "mesh.data=1",
        "checkpoint.every_steps=2"]
STEPS, EVERY = 24, 2  # room for four attacks of a few steps each, and a save every other step
SEED = int(os.environ.get("MAXMOE_CHAOS_SEED", "0"))
TMP = "orbax-checkpoint-tmp"  # Orbax's name for a step directory whose save is in flight


def cli_env(tmp_path: Path) -> dict:
    """Environment for CLI subprocesses: caches under tmp_path, compiled programs reused."""
    env = dict(os.environ, MAXMOE_CACHE=str(tmp_path / "cache"),
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "xla_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("XLA_FLAGS", None)  # the CLI fakes its own devices (mesh.cpu_devices)
    return env


class Run:
    """One `maxmoe train` subprocess whose stderr lines are collected as they arrive."""

    def __init__(self, run_dir: Path, env: dict, steps: int = STEPS, every: int = EVERY,
                 extra: tuple[str, ...] = ()):
        cmd = [sys.executable, "-m", "maxmoe.cli", "train", *TINY, f"train.steps={steps}",
               f"checkpoint.every_steps={every}", f"run.dir={run_dir}", *extra]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 300) -> str:
        """The first stderr line containing `text`; fails if the run ends or times out first."""
        deadline = time.monotonic() + timeout
        while True:
            found = next((line for line in self.lines if text in line), None)
            if found is not None:
                return found
            assert self.proc.poll() is None, \
                f"exited {self.proc.returncode} before {text!r}:\n" + "".join(self.lines[-30:])
            assert time.monotonic() < deadline, f"no {text!r} in {timeout}s"
            time.sleep(0.01)

    def start_step(self) -> int:
        """The step this run resumed from (0: a fresh start), once it is about to train."""
        return int(self.wait_for("; steps ").split("; steps ")[1].split(" ")[0])

    def kill(self) -> None:
        """kill -9, asserting that it hit a live process (the run had not ended by itself)."""
        assert self.proc.poll() is None, f"exited {self.proc.returncode} before the kill"
        self.proc.kill()
        assert self.proc.wait(timeout=60) == -signal.SIGKILL

    def finish(self, timeout: float = 300) -> tuple[int, dict | None]:
        # not communicate(): it reads stderr too, taking lines from the reader thread and
        # closing the pipe under it. stdout holds only the summary line (fits a pipe's buffer)
        self.proc.wait(timeout=timeout)
        out = self.proc.stdout.read()
        self._reader.join(5)
        summary = json.loads(out.splitlines()[-1]) if out.strip() else None
        return self.proc.returncode, summary


def committed(ckpt_dir: Path) -> list[int]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit())


def resume(run_dir: Path, env: dict) -> tuple[Run, int]:
    """Starts the same command again; asserts that it resumed from the newest committed step
    (0 if none) once it is about to train. Returns the run and that step."""
    newest = ([0] + committed(run_dir / "checkpoints"))[-1]
    debris = set(in_flight(run_dir / "checkpoints"))
    run = Run(run_dir, env)
    start = run.start_step()
    assert start == newest, f"resumed from step {start}, not {newest}"
    # a killed save's directory is removed at start (this run's own saves may be under way)
    assert not debris & set(in_flight(run_dir / "checkpoints"))
    return run, start


def in_flight(ckpt_dir: Path) -> list[str]:
    return [p.name for p in ckpt_dir.iterdir() if TMP in p.name] if ckpt_dir.is_dir() else []


def final_params(run_dir: Path):
    cfg, origins = load_config([], TINY + [f"train.steps={STEPS}"])
    sizes = validate(cfg, 1, origins)
    trainer = make_trainer(cfg, make_mesh(sizes, jax.devices()[:1]))
    with Checkpointer(run_dir / "checkpoints", cfg.checkpoint) as ckpt:
        assert ckpt.latest_step() == STEPS
        state, _ = ckpt.restore(trainer.abstract_state)
    return jax.device_get(state)


@pytest.mark.slow
def test_kill_mid_save_sigterm_then_resume_bit_identical(tmp_path):
    env = cli_env(tmp_path)
    code, straight = Run(tmp_path / "straight", env).finish()
    assert code == 0 and straight["final_step"] == STEPS

    chaos = tmp_path / "chaos"
    ckpt_dir = chaos / "checkpoints"
    rng = random.Random(SEED)
    print(f"chaos seed {SEED} (MAXMOE_CHAOS_SEED={SEED} replays these attacks)")
    attacks = []  # (attack, step the run resumed from, step attacked at)

    # 1. kill -9 a few steps in
    run, start = resume(chaos, env)
    step = start + rng.randint(3, 6)
    run.wait_for(f"step {step}:")
    run.kill()
    attacks.append(("kill", start, step))

    # 2. kill -9 while the save of a chosen step is in flight: its tmp directory exists
    run, start = resume(chaos, env)
    step = (start // EVERY + rng.randint(1, 3)) * EVERY
    deadline = time.monotonic() + 300
    while not any(name.startswith(f"{step}.") for name in in_flight(ckpt_dir)):
        assert run.proc.poll() is None and step not in committed(ckpt_dir), \
            f"the save of step {step} ended before it was seen in flight; attack missed"
        assert time.monotonic() < deadline
        time.sleep(0.0005)
    run.kill()
    assert any(name.startswith(f"{step}.") for name in in_flight(ckpt_dir))  # still, at death
    assert step not in committed(ckpt_dir)
    attacks.append(("kill mid-save", start, step))

    # 3. SIGTERM after a step: the run saves the next step and exits 75 before the end
    run, start = resume(chaos, env)
    assert start < step  # the half-written step was not used
    step = start + rng.randint(1, 4)
    run.wait_for(f"step {step}:")
    assert run.proc.poll() is None
    run.proc.send_signal(signal.SIGTERM)
    code, summary = run.finish(timeout=120)
    assert code == 75 and summary["preempted"], "".join(run.lines[-30:])
    assert step <= summary["final_step"] < STEPS
    assert committed(ckpt_dir)[-1] == summary["final_step"]
    attacks.append(("sigterm", start, summary["final_step"]))

    # 4. kill -9 again, after a step
    run, start = resume(chaos, env)
    assert start == summary["final_step"]
    step = start + rng.randint(1, 4)
    run.wait_for(f"step {step}:")
    run.kill()
    attacks.append(("kill", start, step))

    # 5. run to the end
    run, start = resume(chaos, env)
    code, summary = run.finish()
    assert code == 0 and summary["final_step"] == STEPS, "".join(run.lines[-30:])
    print("attacks (attack, resumed from, at step):", attacks, "then finished from", start)
    assert not in_flight(ckpt_dir)  # every save of the last run committed
    a, b = final_params(tmp_path / "straight"), final_params(chaos)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    # every step was logged, each once per run that reached it; the last run finished
    logged = [json.loads(line)["step"] for line in (chaos / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1] == STEPS and set(logged) == set(range(1, STEPS + 1))
