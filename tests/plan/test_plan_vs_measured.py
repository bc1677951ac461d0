"""tools/plan_vs_measured.py: the GPU check's side-by-side of the plan and the device."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "plan_vs_measured.py"
spec = importlib.util.spec_from_file_location("plan_vs_measured", TOOL)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

PLAN = {"peak_bytes_per_device": 40 * 2**30, "step_time_s": 0.5, "tokens_per_second": 8000.0,
        "mfu": 0.4, "cluster": "1xh200", "mesh": {"fsdp": 1}, "stand_ins": {}}
BENCH = {"device_peak_bytes": 50 * 2**30, "peak_bytes": 44 * 2**30, "step_time_s": 0.6,
         "tokens_per_second": 6000.0, "mfu": 0.3, "devices": 1}


def test_ratios_are_measured_over_planned_from_the_last_json_lines(tmp_path, capsys):
    plan_out, bench_out = tmp_path / "plan.txt", tmp_path / "bench.json"
    plan_out.write_text("a table\n{not json\n" + json.dumps(PLAN) + "\n")
    bench_out.write_text(json.dumps(BENCH) + "\n")
    assert tool.main([str(plan_out), str(bench_out)]) == 0
    rows = {r["figure"]: r for r in json.loads(capsys.readouterr().out.splitlines()[-1])}
    assert rows["peak memory per device"]["ratio"] == 50 / 40  # the device's own count first
    assert rows["peak memory per device"]["measured_by"] == "device_peak_bytes"
    assert rows["peak, XLA analysis of the device's compile"]["ratio"] == 44 / 40
    assert abs(rows["step time"]["ratio"] - 1.2) < 1e-12
    assert rows["tokens per second"]["ratio"] == 0.75


def test_a_missing_figure_has_no_ratio():
    rows = tool.compare(PLAN, {"step_time_s": 0.6}, {"peak_bytes_per_device": 20 * 2**30})
    by = {r["figure"]: r for r in rows}
    assert by["peak memory per device"]["ratio"] is None
    assert by["peak, plan.json of the device's train run"]["ratio"] == 0.5
    assert "-" in tool.render(rows)
