"""`maxmoe bench` under each C allocator (MAXMOE_MALLOC), in turns, issue 8.

    python tools/bench_malloc.py [CONFIG KEY=VALUE ...] [--rounds 5] [--steps 30]
        [--choices glibc,tcmalloc,jemalloc]

(CONFIG and overrides as for `maxmoe bench`; none: configs/bench/cpu_mixtral_tiny.yaml.)

Each round runs one fresh `maxmoe bench CONFIG --steps STEPS` per allocator, each round in
another order, so a shared host's load changes fall on all alike; prints every run (the
allocator it really ran on, its median step, MFU, page faults and system CPU a step) and then,
per allocator, the median of its per-round ratios to the first one's step time (above 1:
faster). Allocators that are not installed are skipped with a note.
"""

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from maxmoe import malloc


def main():
    p = argparse.ArgumentParser()
    p.add_argument("items", nargs="*", default=["configs/bench/cpu_mixtral_tiny.yaml"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--choices", default="glibc,tcmalloc,jemalloc")
    a = p.parse_args()
    choices = []
    for c in a.choices.split(","):
        if c in malloc.PRELOADS and malloc.find(c) is None:
            print(f"{c}: not installed, skipped", file=sys.stderr)
        else:
            choices.append(c)
    runs = {c: [] for c in choices}
    for i in range(a.rounds):
        for c in choices[i % len(choices):] + choices[:i % len(choices)]:
            out = subprocess.run([sys.executable, "-m", "maxmoe.cli", "bench", *a.items, "--steps",
                                  str(a.steps)], env={**os.environ, malloc.ENV: c},
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs[c].append(r)
            print(f"round {i} {c:9s} ran on {r['allocator']:19s} "
                  f"step {1e3 * r['step_time_s']:6.1f} ms  MFU {100 * r['mfu']:5.1f}%  "
                  f"{r['minor_faults_per_step']:6.0f} faults and "
                  f"{1e3 * r['system_cpu_s_per_step']:5.1f} ms system CPU a step", flush=True)
    base = np.array([r["step_time_s"] for r in runs[choices[0]]])
    summary = {}
    for c in choices:
        t = np.array([r["step_time_s"] for r in runs[c]])
        mfu = [100 * r["mfu"] for r in runs[c]]
        summary[c] = {"speedup_vs_" + choices[0]: float(np.median(base / t)),
                      "step_time_s": float(np.median(t)), "mfu_median": float(np.median(mfu))}
        print(f"{c:9s} median step {1e3 * np.median(t):6.1f} ms, MFU {np.median(mfu):.1f}% "
              f"({min(mfu):.1f}-{max(mfu):.1f}), {choices[0]} step / this one per round "
              f"{np.round(base / t, 3).tolist()}: median {np.median(base / t):.3f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
