"""Times `maxmoe report` on synthetic runs at scale: the 671B preset's router shape (59 MoE
layers x 256 experts, every array of the observability contract on every logged step) and a
100k-step run of scalars. Prints one JSON line per case: seconds, peak RSS, page and metrics
sizes. Run from the repository root:

    python3 tools/report_scale.py [--records 1000] [--steps 100000] [--dir /tmp/report_scale]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ and maxmoe/ from here
from tests.report.fake_runs import CONFIG, record  # noqa: E402

MOE_LAYERS, EXPERTS = 59, 256  # configs/models/deepseek_v3_671b.yaml: 58 MoE layers + MTP


def write(path: Path, records: int, every: int, arrays: bool) -> None:
    """metrics.jsonl of `records` logged steps `every` steps apart; the contract's arrays on
    every record when `arrays`, else on the last one only."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(path / "metrics.jsonl", "w") as f:
        for i in range(1, records + 1):
            step = i * every
            if arrays or i == records:
                rec = record(step, rng, MOE_LAYERS, EXPERTS, {37: [3, 200]})
            else:
                rec = {"step": step, "loss": 3 + 4 * np.exp(-step / 3e4)
                       + 0.05 * rng.standard_normal(), "grad_norm": 1.0,
                       "learning_rate": 1e-4, "tokens_per_second": 1e6, "mfu": 0.4}
            f.write(json.dumps(rec) + "\n")
    (path / "config.yaml").write_text(CONFIG)


def timed_report(path: Path) -> dict:
    """Runs `maxmoe report path` in a child process: its wall time and peak RSS."""
    t = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "maxmoe.cli", "report", str(path)],
                             stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS
    if status != 0:
        raise SystemExit(f"maxmoe report {path} failed ({status})")
    return {"run": path.name, "report_s": round(time.perf_counter() - t, 1),
            "peak_rss_mib": round(usage.ru_maxrss / 1024),
            "metrics_mib": round((path / "metrics.jsonl").stat().st_size / 2**20, 1),
            "page_mib": round((path / "report.html").stat().st_size / 2**20, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=1000, help="671B case: logged steps")
    p.add_argument("--steps", type=int, default=100_000, help="long case: logged steps")
    p.add_argument("--dir", type=Path, default=Path("/tmp/report_scale"))
    args = p.parse_args()
    write(args.dir / "moe671b", args.records, 10, arrays=True)
    print(json.dumps(timed_report(args.dir / "moe671b")), flush=True)
    write(args.dir / "long", args.steps, 1, arrays=False)
    print(json.dumps(timed_report(args.dir / "long")))


if __name__ == "__main__":
    main()
