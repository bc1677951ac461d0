"""Goodput across the restarts of one run: each attempt's wall time splits into timed buckets
(startup, compile, data wait, productive, redone, checkpoint, eval) and idle, the remainder;
the run adds its attempts up with the downtime between them; `maxmoe report` shows them.

Scenario: attempt A trains 5 steps (saves at 2, 4 and 5), then its step-5 checkpoint is
deleted, as if it had been killed before that save; after a pause attempt B resumes from step
4 to 7. Step 5 is then redone work, steps 6-7 productive; the pause is downtime.
"""

import json
import shutil
import time

import jax
import pytest

from maxmoe.report.page import write_report
from maxmoe.train.goodput import BUCKETS, attempts, run_goodput
from maxmoe.train.loop import train
from maxmoe.validation import validate
from tests.helpers import small_config

PAUSE_S = 1.0


def _train(tmp_path, steps: int) -> dict:
    cfg, origins = small_config("model.vocab_size=512", f"train.steps={steps}",
                                "checkpoint.every_steps=2", "checkpoint.async_save=false",
                                "train.eval_every_steps=2", "logging.every_steps=1",
                                "logging.progress_bar=false", f"run.dir={tmp_path / 'run'}")
    return train(cfg, validate(cfg, jax.device_count(), origins))


@pytest.mark.slow
def test_goodput_adds_up_over_restarts_and_counts_redone_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXMOE_CACHE", str(tmp_path / "cache"))
    first = _train(tmp_path, 5)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "5")  # killed before step 5's save
    time.sleep(PAUSE_S)
    second = _train(tmp_path, 7)
    assert second["start_step"] == 4

    a, b = attempts(tmp_path / "run")
    assert (a["reached"], b["reached"]) == (5, 7)
    assert a["redone_s"] == 0.0 and b["redone_s"] > 0.0  # step 5, again
    for rec in (a, b):
        for bucket in ("startup", "compile", "data_wait", "productive", "checkpoint", "eval"):
            assert rec[f"{bucket}_s"] > 0.0, (bucket, rec)
        timed = sum(rec[f"{k}_s"] for k in BUCKETS)
        assert rec["idle_s"] == pytest.approx(rec["wall_s"] - timed, abs=1e-6)
        assert timed <= rec["wall_s"] + 1e-6

    run = run_goodput(tmp_path / "run")
    assert run["attempts"] == 2 and run["down_s"] >= PAUSE_S
    assert run["wall_s"] == pytest.approx(a["wall_s"] + b["wall_s"] + run["down_s"])
    assert run["goodput"] == pytest.approx(run["productive_s"] / run["wall_s"])
    assert 0.0 < run["goodput"] < 1.0
    # the summary's figures are the run's, over both attempts
    assert second["goodput"] == pytest.approx(run["goodput"], abs=1e-3)
    assert first["goodput"] != second["goodput"]
    assert second["goodput_time_s"]["down"] == pytest.approx(run["down_s"], abs=0.1)
    json.dumps(second)  # the summary stays one JSON line
    page, _ = write_report([tmp_path / "run"], tmp_path / "report.html")
    html = page.read_text()
    assert "<h2>Goodput</h2>" in html and f"{100 * run['goodput']:.1f}%" in html
