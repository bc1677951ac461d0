"""Host overhead of `maxmoe train` against the compiled step alone (`maxmoe bench`), issue 8.

    python tools/host_overhead.py [configs/bench/cpu_mixtral_tiny.yaml] [--steps 40]
        [--repeat 2] [--src DIR ...] [KEY=VALUE ...]

Each repeat runs, back to back in fresh subprocesses, for every --src (a source tree put
first on PYTHONPATH, e.g. an export of another commit; default: the installed maxmoe):

  maxmoe train CONFIG train.steps=STEPS logging.every_steps=10 checkpoint.every_steps=1000
               train.eval_every_steps=0 logging.progress_bar=false run.dir=<fresh dir>
  maxmoe bench CONFIG --steps 10

and prints per run: steady-state loop step time (the logging windows after the first, which
holds the warm-up), the bench median step time, host overhead = 1 - bench / loop, and, when
the loop records them, data wait per step, the loop's own host_overhead_fraction (the device
idle) and host_cpu_fraction (the share of the cores' time the host's threads and data workers
used: on a CPU backend the most they take from the step). The last line is one JSON object.
Loop against bench compares two processes run one after the other, which a shared machine's
load moves by up to +-20% (issue 8); the loop's own counters do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# the loop's own per-window host figures (metrics.jsonl, maxmoe/metrics/host.py)
LOOP_KEYS = ("data_wait_s", "host_time_s", "host_overhead_fraction", "host_cpu_s",
             "host_cpu_fraction")


def run(cmd: list[str], src: str | None, cwd: str) -> str:
    env = dict(os.environ)
    # only the first run of a source tree compiles; steady-state step times are unaffected
    env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(cwd, "xla_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if src:
        env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # `python -m` puts the working directory first on sys.path: run from a neutral one, so
    # PYTHONPATH decides which maxmoe is imported
    proc = subprocess.run([sys.executable, "-m", "maxmoe.cli", *cmd], env=env, cwd=cwd,
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def _imported(src: str | None, cwd: str) -> str:
    env = dict(os.environ, PYTHONPATH=src or os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", "import maxmoe; print(maxmoe.__file__)"],
                          env=env, cwd=cwd, capture_output=True, text=True).stdout.strip()


def loop_figures(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records[1:] if r.get("step_time_s")]  # records[0]: warm-up window
    if not steady:
        sys.exit(f"no steady-state window in {run_dir}: raise --steps")
    out = {"loop_step_s": float(np.median([r["step_time_s"] for r in steady])),
           "windows": len(steady)}
    for key in LOOP_KEYS:
        if all(key in r for r in steady):
            out[key] = float(np.median([r[key] for r in steady]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="*", default=[], metavar="CONFIG_OR_KEY=VALUE")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--bench-steps", type=int, default=10)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--src", action="append", default=[],
                   help="source tree to test (repeatable; default: the installed maxmoe)")
    args = p.parse_args()
    items = args.items or ["configs/bench/cpu_mixtral_tiny.yaml"]
    items = [str(Path(i).resolve()) if i.endswith((".yaml", ".yml")) else i for i in items]
    sources = [str(Path(s).resolve()) for s in args.src] or [None]
    results = []
    with tempfile.TemporaryDirectory(prefix="host_overhead_") as tmp:
        for repeat in range(args.repeat):
            for index, src in enumerate(sources):
                run_dir = Path(tmp) / f"run{repeat}_{index}"
                run(["train", *items, f"train.steps={args.steps}", "logging.every_steps=10",
                     "checkpoint.every_steps=1000", "train.eval_every_steps=0",
                     "logging.progress_bar=false", f"run.dir={run_dir}"], src, tmp)
                r = loop_figures(run_dir)
                bench = json.loads(run(["bench", *items, "--steps", str(args.bench_steps)],
                                       src, tmp).splitlines()[-1])
                r.update(src=src or "installed", repeat=repeat, imported=_imported(src, tmp),
                         bench_step_s=bench["step_time_s"],
                         host_overhead=1 - bench["step_time_s"] / r["loop_step_s"])
                results.append(r)
                extra = "".join(f" {k} {r[k]:.4f}" for k in LOOP_KEYS if k in r)
                print(f"[{repeat}] {r['imported']}: loop {r['loop_step_s']:.3f} s/step, bench "
                      f"{r['bench_step_s']:.3f} s/step, host overhead "
                      f"{100 * r['host_overhead']:.1f}%{extra}", file=sys.stderr, flush=True)
    for src in sources:
        mine = [r for r in results if r["src"] == (src or "installed")]
        own = "".join(f", {k} {100 * np.median([r[k] for r in mine]):.1f}%" for k in (
            "host_overhead_fraction", "host_cpu_fraction") if all(k in r for r in mine))
        print(f"{mine[0]['imported']}: median over {len(mine)} repeats: host overhead "
              f"{100 * np.median([r['host_overhead'] for r in mine]):.1f}%{own}", file=sys.stderr)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
