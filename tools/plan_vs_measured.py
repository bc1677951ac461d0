"""The planner's prediction next to what a device measured, with their ratio.

    python3 tools/plan_vs_measured.py PLAN_OUT BENCH_OUT [--train-plan PLAN_JSON]

PLAN_OUT: the output of `maxmoe plan CONFIG --cluster ...` (its last JSON line is read).
BENCH_OUT: the output of `maxmoe bench CONFIG` of the same config on the device (last JSON line).
--train-plan: <run.dir>/plan.json of a `maxmoe train` of the config on that device (the same
figures from the real device's compile), optional.
Prints one row per figure (peak memory per device, step time, tokens/s, MFU) with
measured / planned, then one JSON line of those rows. tools/gpu_check.sh runs it on the H200.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GIB = 2.0**30


def last_json(path: str) -> dict:
    """The last line of `path` that is a JSON object (a maxmoe command's result line)."""
    for line in reversed(Path(path).read_text().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise SystemExit(f"plan_vs_measured: {path}: no JSON result line (did the command fail?)")


def ratio(measured: float | None, planned: float | None) -> float | None:
    return None if not measured or not planned else measured / planned


def compare(plan: dict, bench: dict, train_plan: dict | None = None) -> list[dict]:
    """Rows {figure, planned, measured, ratio (measured / planned), unit, how}: the plan's
    peak bytes and roofline against the device's own peak (memory_stats' peak_bytes_in_use,
    else XLA's analysis of the device compile) and the bench's median step."""
    measured_peak = bench.get("device_peak_bytes") or bench.get("peak_bytes")
    rows = [
        ("peak memory per device", plan["peak_bytes_per_device"], measured_peak, "GiB",
         "device_peak_bytes" if bench.get("device_peak_bytes") else "bench peak_bytes (XLA)"),
        ("peak, XLA analysis of the device's compile", plan["peak_bytes_per_device"],
         bench.get("peak_bytes"), "GiB", "bench peak_bytes"),
        ("step time", plan["step_time_s"], bench.get("step_time_s"), "s", "bench median"),
        ("tokens per second", plan["tokens_per_second"], bench.get("tokens_per_second"), "",
         "bench"),
        ("MFU", plan["mfu"], bench.get("mfu"), "", "bench, against its own stated peak"),
    ]
    if train_plan is not None:
        rows.append(("peak, plan.json of the device's train run", plan["peak_bytes_per_device"],
                     train_plan.get("peak_bytes_per_device"), "GiB", "train plan.json"))
    return [{"figure": f, "planned": p, "measured": m, "ratio": ratio(m, p), "unit": u,
             "measured_by": how} for f, p, m, u, how in rows]


def _value(x: float | None, unit: str) -> str:
    if x is None:
        return "-"
    return f"{x / GIB:.3f} GiB" if unit == "GiB" else f"{x:.4g}{' ' + unit if unit else ''}"


def render(rows: list[dict]) -> str:
    """The rows as an aligned text table."""
    head = f"{'figure':<44} {'planned':>14} {'measured':>14} {'measured/planned':>17}  measured by"
    lines = [head, "-" * len(head)]
    for r in rows:
        rat = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"{r['figure']:<44} {_value(r['planned'], r['unit']):>14} "
                     f"{_value(r['measured'], r['unit']):>14} {rat:>17}  {r['measured_by']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plan")
    parser.add_argument("bench")
    parser.add_argument("--train-plan", default="")
    args = parser.parse_args(argv)
    plan, bench = last_json(args.plan), last_json(args.bench)
    train_plan = json.loads(Path(args.train_plan).read_text()) if args.train_plan and \
        Path(args.train_plan).is_file() else None
    rows = compare(plan, bench, train_plan)
    print(f"plan: {plan.get('cluster')} mesh {plan.get('mesh')}, compiled on fake CPU devices "
          f"with stand-ins {plan.get('stand_ins')}; bench: {bench.get('devices')} device(s)")
    print(render(rows))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
