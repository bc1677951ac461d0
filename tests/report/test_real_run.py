"""`maxmoe report` on what a real `maxmoe train` run writes (configs/tiny.yaml, a few steps),
whole and with its last line cut as a kill leaves it."""

from __future__ import annotations

import pytest

from maxmoe.cli import main


@pytest.mark.slow
def test_report_of_a_real_tiny_run_whole_and_killed(tmp_path, capsys):
    run = tmp_path / "tiny"
    assert main(["train", "configs/tiny.yaml", f"run.dir={run}", "train.steps=4",
                 "logging.every_steps=2", "train.eval_every_steps=0",
                 "checkpoint.enabled=false", "logging.progress_bar=false"]) == 0
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert "<td class=num>2</td><td>2-4</td>" in page  # two logged steps: 2 and 4
    assert "config.yaml</summary>" in page and "<h2>Plan</h2>" in page
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-40])  # killed while writing step 4's record
    capsys.readouterr()
    assert main(["report", str(run), "--out", str(tmp_path / "killed.html")]) == 0
    assert "line 2 (the last, cut off" in capsys.readouterr().err
    assert "<td class=num>1</td><td>2-2</td>" in (tmp_path / "killed.html").read_text()
