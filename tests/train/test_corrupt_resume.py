"""A data file of the newest checkpoint truncated, or one byte flipped inside an array's saved
data, then the same `maxmoe train` command again: the run resumes from the previous step, says
so in one warning (naming the array, for the flip), and prints nothing that looks like a crash
(no traceback from the failed restore's reads). Without checksums the flip resumes silently."""

import os
import shutil

import pytest

from tests.train.test_chaos import Run, cli_env
from tests.train.test_checksums import EMBEDDING, flip_byte

STEPS, EVERY = 4, 2


def trained(tmp_path):
    """(CLI environment, run dir) of a run trained STEPS steps, saving every EVERY."""
    env, run_dir = cli_env(tmp_path), tmp_path / "run"
    code, summary = Run(run_dir, env, steps=STEPS, every=EVERY).finish(timeout=300)
    assert code == 0 and summary["final_step"] == STEPS
    return env, run_dir


def resumed(run_dir, env, *extra) -> tuple[int, dict, Run]:
    """The same command again, EVERY steps further: (exit code, summary, the run)."""
    run = Run(run_dir, env, steps=STEPS + EVERY, every=EVERY, extra=extra)
    code, summary = run.finish(timeout=300)
    return code, summary, run


@pytest.mark.slow
def test_truncated_newest_step_resumes_from_the_previous_one_without_a_traceback(tmp_path):
    env, run_dir = trained(tmp_path)
    chunks = run_dir / "checkpoints" / str(STEPS) / "state" / "ocdbt.process_0" / "d"
    biggest = max(chunks.iterdir(), key=lambda p: p.stat().st_size)  # holds many arrays
    os.truncate(biggest, biggest.stat().st_size // 2)

    code, summary, run = resumed(run_dir, env)
    err = "".join(run.lines)
    assert code == 0, err[-3000:]
    assert summary["start_step"] == STEPS - EVERY and summary["final_step"] == STEPS + EVERY
    assert (tmp_path / "run" / "checkpoints.quarantine" / str(STEPS)).is_dir()
    assert f"warning: checkpoint step {STEPS} could not be restored" in err, err[-3000:]
    for crash in ("Traceback", "Exception ignored", "Event loop is closed",
                  "never retrieved"):
        assert crash not in err, err[-3000:]


@pytest.mark.slow
def test_flipped_byte_resumes_silently_without_checksums_and_is_named_with_them(tmp_path):
    env, run_dir = trained(tmp_path)
    flip_byte(run_dir / "checkpoints" / str(STEPS), EMBEDDING)
    shutil.copytree(run_dir, tmp_path / "off")

    # checkpoint.checksums=false: the flipped step is resumed, and nothing is said
    code, summary, off = resumed(tmp_path / "off", env, "checkpoint.checksums=false")
    err = "".join(off.lines)
    assert code == 0 and summary["start_step"] == STEPS, err[-3000:]
    assert "warning" not in err and not (tmp_path / "off" / "checkpoints.quarantine").exists()

    # with checksums (the default): quarantined, the previous step resumed, one line naming it
    code, summary, on = resumed(run_dir, env)
    err = "".join(on.lines)
    assert code == 0 and summary["start_step"] == STEPS - EVERY, err[-3000:]
    assert (run_dir / "checkpoints.quarantine" / str(STEPS)).is_dir()
    lines = [x for x in on.lines if EMBEDDING in x]
    assert len(lines) == 1, lines
    [line] = lines
    assert line.startswith(f"warning: checkpoint step {STEPS} could not be restored "
                           f"(ChecksumError: array {EMBEDDING} chunk [0:512, 0:64]: crc32c "), line
    assert "Traceback" not in err, err[-3000:]
