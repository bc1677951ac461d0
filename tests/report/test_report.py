"""`maxmoe report`: renders killed runs, overlays runs, stays self-contained, and turns bad input
into one line and exit 2 (synthetic run dirs with the observability contract's keys)."""

from __future__ import annotations

import json
import re

import numpy as np

from maxmoe.cli import main
from maxmoe.report.figures import MAX_POINTS, downsample, event_steps
from maxmoe.report.runs import MAX_SAMPLES, load_run, run_names
from tests.report.fake_runs import write_run

# a URL a browser would fetch: src=/href= (also xlink:href, srcset, CSS url()) to http(s) or //
REMOTE = re.compile(r"""(?:\b(?:src|href|srcset)\s*=\s*["']?\s*|url\(\s*["']?)(?:https?:|//)""",
                    re.IGNORECASE)


def test_a_killed_run_renders_from_the_complete_lines_and_says_what_it_skipped(tmp_path, capsys):
    run = write_run(tmp_path / "killed", steps=40, every=2, truncate=True)
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    err = capsys.readouterr().err
    # 20 lines written, the 20th cut in half: 19 records (steps 2..38) shown
    assert "line 20 (the last, cut off" in err
    assert "line 20 (the last, cut off" in page  # the page says it too
    assert "<td class=num>19</td><td>2-38</td>" in page
    assert page.count('alt="expert load, layer') == 3  # one heatmap per MoE layer (1, 2, 3)
    assert "Traceback" not in err


def test_several_runs_overlay_with_their_names_in_the_legends(tmp_path):
    a = write_run(tmp_path / "alpha", steps=20)
    b = write_run(tmp_path / "beta", steps=30)
    out = tmp_path / "compare.html"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    page = out.read_text()
    svgs = re.findall(r"<svg.*?</svg>", page, re.DOTALL)
    assert len(svgs) >= 3  # loss, optimization, throughput
    for svg in svgs[:3]:  # legend text (svg.fonttype none keeps it as text)
        assert ">alpha<" in svg and ">beta<" in svg, svg[:200]
    assert not (a / "report.html").exists()  # --out replaced the default


def test_the_page_fetches_nothing(tmp_path):
    run = write_run(tmp_path / "run")
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert REMOTE.findall(page) == []
    assert "<script" not in page.lower() and "<link" not in page.lower()
    assert REMOTE.search('<img src="https://x/y.png">')  # the check can fail
    assert page.count("data:image/png;base64,") >= 3


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "only_cut").mkdir()
    (tmp_path / "only_cut" / "metrics.jsonl").write_text('{"step": 1, "loss": 3.')
    says = {"missing": "does not exist", "afile": "is a file, not a run directory",
            "empty": "has no metrics.jsonl", "only_cut": "has no complete record"}
    for bad, why in says.items():
        assert main(["report", str(tmp_path / bad)]) == 2, bad
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("maxmoe: error: report:"), err
        assert why in err, err


def test_a_run_without_metrics_is_left_out_when_another_renders(tmp_path, capsys):
    good = write_run(tmp_path / "good")
    (tmp_path / "empty").mkdir()
    assert main(["report", str(good), str(tmp_path / "empty")]) == 0
    page = (good / "report.html").read_text()
    assert "empty: left out: it has no metrics.jsonl" in page
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_a_rollback_replaces_the_steps_logged_after_its_checkpoint(tmp_path):
    lines = [{"step": s, "loss": 10.0 - s} for s in range(1, 11)]  # first pass to step 10
    lines += [{"step": s, "loss": 100.0 + s} for s in range(6, 9)]  # rolled back to 5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = load_run(tmp_path)
    loss = run.scalars["loss"]
    assert loss.steps.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert loss.values.tolist() == [9.0, 8.0, 7.0, 6.0, 5.0, 106.0, 107.0, 108.0]


def test_arrays_are_sampled_and_skips_come_from_events_and_metrics(tmp_path):
    run = load_run(write_run(tmp_path / "r", steps=2 * (MAX_SAMPLES + 50), every=2, skip_step=20))
    load = run.arrays["expert_load_fraction"]
    assert load.values.shape[1:] == (3, 8) and len(load.steps) <= MAX_SAMPLES + 1
    assert load.steps[-1] == 2 * (MAX_SAMPLES + 50)  # the newest record is always kept
    np.testing.assert_allclose(load.values.sum(axis=2), 1.0, atol=1e-5)  # rows sum to 1
    assert run.arrays["grad_norm_by_group/attention"].values.shape[1] == 4
    assert run.scalars["grad_norm_by_group/embedding"].values[0] == 0.5
    assert run.dead_experts == {"1": [5]} and run.dead_since[("1", 5)] == 2
    kinds = event_steps(run)
    assert kinds["skip"].tolist() == [20] and kinds["dead_experts"].tolist() == [30]


def test_downsampling_keeps_a_one_step_spike():
    steps = np.arange(100_000)
    values = np.ones(100_000)
    values[54_321] = 50.0
    s, v = downsample(steps, values)
    assert len(s) <= MAX_POINTS and v.max() == 50.0 and s[np.argmax(v)] == 54_321
    assert np.all(np.diff(s) > 0)


def test_run_names_tell_same_named_dirs_apart(tmp_path):
    names = run_names([tmp_path / "a" / "tiny", tmp_path / "b" / "tiny", tmp_path / "c"])
    assert names == ["a/tiny", "b/tiny", f"{tmp_path.name}/c"]


def test_odd_records_and_a_garbled_plan_still_render(tmp_path, capsys):
    """Keys of the wrong type or shape are left out, not a traceback: a run of another
    version, or a hand-edited file, still gets its page."""
    records = [{"step": 1}, {"step": 2, "loss": None, "expert_load_fraction": [0.5, 0.5]},
               {"step": 3, "loss": "high", "grad_norm_by_group": {"x": {"y": 1}},
                "weird": [["a"]], "ragged": [[1.0], [1.0, 2.0]], "dead_experts": {"0": ["x"]}},
               {"step": 4, "loss": 2.0, "learning_rate": float("nan")}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "events.jsonl").write_text('{"step": 3, "kind": "stop", "message": "<b>x</b>"}\n'
                                           '{"kind": "skip"}\n')
    (tmp_path / "plan.json").write_text(json.dumps({
        "memory_by_part": {"parameters": "many"}, "mesh": [1, 2],
        "collective_bytes_per_step": {"data": {"all-reduce": {"ici": "x"}}, "fsdp": 3}}))
    (tmp_path / "config.yaml").write_text("model: [unclosed\n")
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    err = capsys.readouterr().err
    assert "events.jsonl: skipped line 2" in err and "config.yaml: not valid YAML" in err
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page  # messages are escaped
    assert "No <code>expert_load_fraction</code>" in page  # [2] is not [L_moe, E]
