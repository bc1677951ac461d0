"""`maxmoe eval` is the train loop's eval: on a checkpoint of a step the run evaluated, it gives
metrics.jsonl's eval_loss exactly (same batches, same compiled forward, same mesh); bad input is
one line and exit 2. The tiny run also has a profiling window (logging.profile_start), whose
trace and printed breakdown are checked here too, so that one run serves both."""

import contextlib
import io
import json
import math

import pytest

from maxmoe.cli import main
from tests.helpers import SMALL

RUN = [*SMALL, "model.vocab_size=512", "mesh.fsdp=2", "mesh.expert=2", "model.remat_policy=none",
       "train.steps=4", "train.eval_every_steps=2", "train.eval_batches=2",
       "checkpoint.every_steps=2", "logging.every_steps=1", "logging.progress_bar=false",
       "logging.profile_start=2", "logging.profile_steps=2"]


def cli(*argv) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(run dir, train's stderr) of a 4-step run: evals at 2 and 4, saves at 2 and 4, steps 2-3
    traced."""
    run_dir = tmp_path_factory.mktemp("evalprof") / "run"
    code, _, err = cli("train", *RUN, f"run.dir={run_dir}")
    assert code == 0, err
    return run_dir, err


def logged_eval_losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


@pytest.mark.slow
def test_eval_equals_the_in_loop_eval_loss(run):
    """Bitwise: the run dir (its newest step, 4) and the step-2 folder against the eval losses
    the loop logged at those steps (tolerance 0: the same computation on the same inputs)."""
    run_dir, _ = run
    logged = logged_eval_losses(run_dir)
    assert sorted(logged) == [2, 4]
    for path, step in [(run_dir, 4), (run_dir / "checkpoints" / "2", 2)]:
        code, out, err = cli("eval", str(path))
        assert code == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        assert result["step"] == step and result["batches"] == 2
        assert result["eval_loss"] == logged[step], (result, logged)
        assert result["perplexity"] == pytest.approx(math.exp(logged[step]), rel=1e-12)
        assert result["tokens"] == 2 * 16 * 32 and result["tokens_per_second"] > 0
        assert f"eval loss   {logged[step]:.4f}" in err
    # more batches read more of the split: another figure, from the same restored params
    code, out, _ = cli("eval", str(run_dir), "--batches", "3")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["batches"] == 3


@pytest.mark.slow
def test_train_traces_the_profiling_window_and_prints_the_breakdown(run):
    run_dir, err = run
    assert "profile: steps 2-3 traced into" in err and "costliest ops:" in err
    table = err[err.index("profile: steps 2-3"):]
    assert "fwd ms" in table and "moe: grouped matmul" in table
    profile = run_dir / "profile"
    assert len(list(profile.rglob("*.xplane.pb"))) == 1  # one window, one trace
    assert list(profile.rglob("*.trace.json.gz"))
    parts = json.loads((profile / "breakdown.json").read_text())["parts"]
    assert sum(r["total_ms"] for r in parts) > 0


@pytest.mark.slow
def test_eval_with_another_model_layout_is_one_line(run):
    run_dir, _ = run
    code, _, err = cli("eval", str(run_dir), "moe.num_experts=4")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "holds another model layout" in lines[0], err


@pytest.mark.parametrize("make, expected", [
    (lambda p: p / "missing", "no such directory"),
    (lambda p: p, "holds no committed checkpoint"),
    (lambda p: (p / "checkpoints" / "7.orbax-checkpoint-tmp-1" / "state").mkdir(parents=True)
     or p, "holds no committed checkpoint"),  # a save still in progress is not a checkpoint
])
def test_bad_path_is_one_line_exit_2(tmp_path, make, expected):
    code, out, err = cli("eval", str(make(tmp_path)))
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("maxmoe: error: checkpoint ") and expected in lines[0]


def test_step_folder_without_a_config_is_one_line_exit_2(tmp_path):
    (tmp_path / "checkpoints" / "3" / "state").mkdir(parents=True)
    code, _, err = cli("eval", str(tmp_path / "checkpoints" / "3"))
    assert code == 2 and "found neither" in err and len(err.strip().splitlines()) == 1
