"""Process 0's side work (plan.json, train.reporting.side_work) cannot stall or kill the job:
a first_compiled hook that raises, or runs past logging.side_work_timeout_s, costs one warning
line; the run trains to train.steps and its summary's plan_json_s is None. A unit case shows
the timeout bound holds while the work is still running."""

import json
import threading
import time

import jax
import pytest

from maxmoe.train.loop import train
from maxmoe.train.reporting import side_work
from maxmoe.validation import validate
from tests.helpers import small_config


def test_side_work_returns_its_value_or_warns_once(capsys):
    assert side_work("x.json", 5, lambda: 1.5) == 1.5
    release = threading.Event()
    t = time.perf_counter()
    assert side_work("slow.json", 0.2, lambda: release.wait(60) and 1.0) is None
    assert time.perf_counter() - t < 5  # bounded, though the work still runs
    release.set()
    assert side_work("bad.json", 5, lambda: 1 / 0) is None
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "warning: slow.json not written (took over logging.side_work_timeout_s=0.2 s); "
        "training goes on without it",
        "warning: bad.json not written (ZeroDivisionError: division by zero); training goes "
        "on without it"]


def _broken_plan(*args, **kwargs):
    raise RuntimeError("the HLO parser met something new")


@pytest.mark.slow
def test_a_failing_plan_hook_is_one_warning_and_the_run_trains(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MAXMOE_CACHE", str(tmp_path / "cache"))
    cfg, origins = small_config("model.vocab_size=512", "train.steps=2", "logging.every_steps=1",
                                "logging.progress_bar=false", "checkpoint.enabled=false",
                                f"run.dir={tmp_path / 'run'}")
    summary = train(cfg, validate(cfg, jax.device_count(), origins),
                    first_compiled=_broken_plan)
    err = capsys.readouterr().err
    assert summary["final_step"] == 2 and summary["plan_json_s"] is None
    assert err.count("warning: plan.json not written (RuntimeError: the HLO parser met "
                     "something new); training goes on without it") == 1, err[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2]
