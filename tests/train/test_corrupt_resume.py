"""A data file of the newest checkpoint truncated, then the same `maxmoe train` command again:
the run resumes from the previous step, says so in one warning, and prints nothing that looks
like a crash (no traceback from the failed restore's reads)."""

import os

import pytest

from tests.train.test_chaos import Run, cli_env

STEPS, EVERY = 4, 2


@pytest.mark.slow
def test_truncated_newest_step_resumes_from_the_previous_one_without_a_traceback(tmp_path):
    env = cli_env(tmp_path)
    run_dir = tmp_path / "run"
    code, summary = Run(run_dir, env, steps=STEPS, every=EVERY).finish(timeout=300)
    assert code == 0 and summary["final_step"] == STEPS
    chunks = run_dir / "checkpoints" / str(STEPS) / "state" / "ocdbt.process_0" / "d"
    biggest = max(chunks.iterdir(), key=lambda p: p.stat().st_size)  # holds many arrays
    os.truncate(biggest, biggest.stat().st_size // 2)

    resumed = Run(run_dir, env, steps=STEPS + EVERY, every=EVERY)
    code, summary = resumed.finish(timeout=300)
    err = "".join(resumed.lines)
    assert code == 0, err[-3000:]
    assert summary["start_step"] == STEPS - EVERY and summary["final_step"] == STEPS + EVERY
    assert (tmp_path / "run" / "checkpoints.quarantine" / str(STEPS)).is_dir()
    assert f"warning: checkpoint step {STEPS} could not be restored" in err, err[-3000:]
    for crash in ("Traceback", "Exception ignored", "Event loop is closed",
                  "never retrieved"):
        assert crash not in err, err[-3000:]
