"""Readers of a run are read-only: `maxmoe eval` and `maxmoe forward` (every reader of a run's
params goes through train.saved_steps.restore_params) work while the job saves, and never
clean or lock anything.

- During an async save held in flight (its commit gated here), the reader gives the figures of
  the newest committed step (the eval loss the run logged at that step), the save's
  `*.orbax-checkpoint-tmp*` directory is still there after it, and the save then commits.
- A reader whose step is deleted under it (the job's checkpoint.keep) ends with one line and
  exit 2, never a traceback or a half-read.
"""

from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest

from maxmoe.cli import main
from maxmoe.config import CheckpointConfig
from maxmoe.config_files import load_config
from maxmoe.sharding import make_mesh
from maxmoe.train import checkpoint_handlers
from maxmoe.train.checkpoint import Checkpointer
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate
from tests.helpers import SMALL

TMP = "orbax-checkpoint-tmp"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run trained one step, saved, with its eval loss logged at that step."""
    root = tmp_path_factory.mktemp("readers")
    items = [*SMALL, "model.vocab_size=512", "train.steps=1", "checkpoint.every_steps=1",
             "train.eval_every_steps=1", "logging.progress_bar=false", f"run.dir={root / 'run'}"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MAXMOE_CACHE", str(root / "cache"))
        assert main(["train", *items]) == 0
    return root


class _Gated:
    """An Orbax commit future whose result waits for `gate` first."""

    def __init__(self, future, gate: threading.Event):
        self.future, self.gate = future, gate

    def result(self, timeout=None):
        assert self.gate.wait(120), "the test never opened the gate"
        return self.future.result(timeout)


def test_a_reader_during_an_in_flight_save(run, monkeypatch, capsys):
    monkeypatch.setenv("MAXMOE_CACHE", str(run / "cache"))
    run_dir, gate = run / "run", threading.Event()
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    serialize = checkpoint_handlers.ArrayHandler.serialize

    async def gated(self, *args, **kwargs):
        return [_Gated(f, gate) for f in await serialize(self, *args, **kwargs)]
    monkeypatch.setattr(checkpoint_handlers.ArrayHandler, "serialize", gated)

    cfg, origins = load_config([str(run_dir / "config.yaml")], [])
    trainer = make_trainer(cfg, make_mesh(validate(cfg, 8, origins)))
    ckpt = Checkpointer(run_dir / "checkpoints", CheckpointConfig(every_steps=1))
    try:
        assert ckpt.save(2, trainer.init(), force=True)
        in_flight = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        assert any(TMP in name for name in in_flight), in_flight
        capsys.readouterr()
        assert main(["eval", str(run_dir)]) == 0
        report = json.loads(capsys.readouterr().out.splitlines()[-1])
        # forward (like generate and convert to-hf) once opened a CheckpointManager, whose
        # start-up cleanup deleted the in-flight save
        np.save(run / "ids.npy", np.arange(16, dtype=np.int32).reshape(2, 8))
        assert main(["forward", str(run_dir), "--input", str(run / "ids.npy"),
                     "--output", str(run / "logits.npy")]) == 0
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == in_flight
    finally:
        gate.set()
        ckpt.close()
    logits = np.load(run / "logits.npy")
    assert logits.shape == (2, 8, 512) and np.isfinite(logits).all()
    assert report["step"] == 1
    assert report["eval_loss"] == pytest.approx(logged[-1]["eval_loss"], rel=1e-6)
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["1", "2"], names  # the save committed after the reader


def test_a_step_deleted_under_its_reader_is_one_line(run, monkeypatch, capsys):
    monkeypatch.setenv("MAXMOE_CACHE", str(run / "cache"))
    copy = run / "copy"
    shutil.copytree(run / "run", copy)
    step_dir = copy / "checkpoints" / "1"
    deserialize = checkpoint_handlers.ArrayHandler.deserialize

    async def deleted_first(self, *args, **kwargs):  # checkpoint.keep, as the reads begin
        shutil.rmtree(step_dir, ignore_errors=True)
        return await deserialize(self, *args, **kwargs)
    monkeypatch.setattr(checkpoint_handlers.ArrayHandler, "deserialize", deleted_first)
    capsys.readouterr()
    assert main(["eval", str(step_dir)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "was deleted while it was read" in err[0], err[-5:]
