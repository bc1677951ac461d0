"""What the metric writers cost (issue 26, docs/performance/observability.md "Metric writers").

    python tools/bench_writers.py loop [configs/tiny.yaml] [--steps 40] [--repeat 2]
        [--every 1 10] [--synthetic]
    python tools/bench_writers.py size [--records 50]

loop: `maxmoe train CONFIG train.steps=STEPS logging.every_steps=K train.eval_every_steps=0
checkpoint.enabled=false logging.progress_bar=false logging.tensorboard=B` in fresh
subprocesses, B = true then false in turns (paired: the two runs of a pair are adjacent), for
each K; prints per run the median over the logging windows after the first (which holds the
warm-up) of step_time_s, host_overhead_fraction, host_cpu_fraction and host_cpu_s (CPU of
the loop's Python threads, the writers' included), then the medians of the on/off ratios.
--synthetic adds contract-shaped per-layer arrays (obs_contract.md: [L_moe, E] load and bias,
[L] and [L_moe] vectors, grad-norm groups) of the config's layer and expert counts to every
logged record, as the per-layer metrics will, so TensorBoard also writes
histograms and the heatmap; metrics.jsonl is written in both arms.

size: writes N synthetic records of the 671B preset's shapes (61 + 1 MTP layers, 58 + 1 MoE
layers, 256 experts, 30 scalars) through the TensorBoard writer and reports the event file's
bytes per 1000 logged steps (scaled from N), by kind (scalars, histograms, heatmap images,
frames), the JSONL bytes per 1000 records, and each writer's CPU time per record (the
TensorBoard writer runs in a background thread of the loop, the JSONL one on the loop's
thread). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCALARS = 30  # about as many scalars as a record of the loop has


def synthetic(rng, layers: int, moe_layers: int, experts: int, dense: int,
              scalars: int = SCALARS) -> dict:
    """A record with every per-layer key of the observability contract (random float32 arrays,
    as the device computes them)."""
    load = rng.dirichlet(np.ones(experts), moe_layers).astype(np.float32)
    return {
        **{f"scalar_{i:02d}": float(rng.random()) for i in range(scalars)},
        "expert_load_fraction": load,
        "router_bias": 1e-3 * rng.standard_normal(load.shape, np.float32),
        "router_entropy": rng.random(moe_layers, np.float32),
        "dropped_fraction_by_layer": np.zeros(moe_layers, np.float32),
        "load_max_mean_ratio": 1 + rng.random(moe_layers, np.float32),
        "load_cv": rng.random(moe_layers, np.float32),
        "activation_rms_by_layer": rng.random(layers, np.float32),
        "update_ratio_by_layer": rng.random(layers, np.float32),
        "grad_norm_by_group": {
            "attention": rng.random(layers, np.float32), "norms": rng.random(layers, np.float32),
            "router": rng.random(moe_layers, np.float32),
            "experts": rng.random(moe_layers, np.float32),
            "shared": rng.random(moe_layers, np.float32),
            "dense_mlp": rng.random(dense, np.float32),
            "embedding": float(rng.random()), "head": float(rng.random())},
        "dead_experts": {}, "dead_expert_count": 0,
    }


def _event_kinds(directory: Path) -> dict[str, int]:
    """Bytes of the event files by value kind (simple_value, histo, image; the TFRecord frame
    and event header of each event counted as "frames")."""
    from tensorboardX.proto import event_pb2  # tools only: the loop needs no proto reader

    out: dict[str, int] = {"frames": 0}
    for path in directory.glob("events.out.tfevents.*"):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
            values = 0
            for v in event.summary.value:
                kind = v.WhichOneof("value")
                out[kind] = out.get(kind, 0) + v.ByteSize()
                values += v.ByteSize()
            out["frames"] += n + 16 - values
            at += n + 16
    return out


def size(records: int) -> dict:
    # imported here, after main() put this tree first on sys.path
    from maxmoe.metrics.tensorboard import TensorBoardWriter
    from maxmoe.metrics.writers import MetricsWriter

    rng = np.random.default_rng(0)
    recs = [synthetic(rng, 62, 59, 256, 3) for _ in range(records)]
    with tempfile.TemporaryDirectory(prefix="bench_writers_") as tmp:
        tb, jsonl = TensorBoardWriter(Path(tmp) / "tb"), MetricsWriter(Path(tmp), enabled=True)
        tb.write(0, recs[0])  # warm-up: the heatmap's figure is built once
        # CPU time, not wall time: a shared machine's load moves the wall time, not this
        t = time.process_time()
        for step, rec in enumerate(recs, 1):
            tb.write(step * 10, rec)
        tb_cpu = (time.process_time() - t) / records
        tb.close()
        t = time.process_time()
        for step, rec in enumerate(recs, 1):
            jsonl.write(step, rec)
        jsonl_cpu = (time.process_time() - t) / records
        jsonl.close()
        kinds = _event_kinds(Path(tmp) / "tb")
        jsonl_bytes = (Path(tmp) / "metrics.jsonl").stat().st_size
    scale = 1000 / (records + 1)  # + the warm-up record
    out = {"records": records, "tb_bytes_per_1000": int(sum(kinds.values()) * scale),
           **{f"tb_{k}_bytes_per_1000": int(v * scale) for k, v in kinds.items()},
           "jsonl_bytes_per_1000": int(jsonl_bytes * 1000 / records),
           "tb_cpu_s_per_record": round(tb_cpu, 4), "jsonl_cpu_s_per_record": round(jsonl_cpu, 4)}
    for k, v in out.items():
        print(f"{k}: {v / 2**20:.1f} MiB" if k.endswith("per_1000") else f"{k}: {v}",
              file=sys.stderr)
    return out


def child(argv: list[str]) -> int:
    """`maxmoe train ARGV` in this process, with contract-shaped arrays in every record."""
    # imported here, after main() put this tree first on sys.path
    from maxmoe.cli import main
    from maxmoe.config_files import load_config
    from maxmoe.train import hooks

    cfg, _ = load_config([a for a in argv if a.endswith(".yaml")],
                         [a for a in argv if "=" in a])
    m = cfg.model
    moe = m.num_layers - m.num_dense_layers + (1 if m.mtp_depth else 0)
    layers, rng, close = m.num_layers + m.mtp_depth, np.random.default_rng(0), hooks.LogWindow.close

    def with_arrays(self, host, extra):
        rec = close(self, host, extra)
        # the loop's record has its own scalars: only the arrays are added
        rec.update(synthetic(rng, layers, moe, cfg.moe.num_experts, m.num_dense_layers, 0))
        return rec
    hooks.LogWindow.close = with_arrays
    return main(["train", *argv])


def _median_of_windows(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows[1:] if r.get("step_time_s")]
    return {k: float(np.median([r[k] for r in steady])) for k in (
        "step_time_s", "host_overhead_fraction", "host_cpu_fraction", "host_cpu_s")}


def loop(args) -> list[dict]:
    config = str(Path(args.config).resolve())
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_writers_") as tmp:
        env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(tmp, "xla_cache"),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        for repeat in range(args.repeat):
            for every in args.every:
                for tb in ("true", "false"):
                    run_dir = Path(tmp) / f"r{repeat}_e{every}_{tb}"
                    cmd = [config, f"train.steps={args.steps}", f"logging.every_steps={every}",
                           "train.eval_every_steps=0", "checkpoint.enabled=false",
                           "logging.progress_bar=false", f"logging.tensorboard={tb}",
                           f"run.dir={run_dir}"]
                    prog = ([sys.executable, __file__, "child"] if args.synthetic else
                            [sys.executable, "-m", "maxmoe.cli", "train"])
                    proc = subprocess.run(prog + cmd, env=env, cwd=tmp, capture_output=True,
                                          text=True)
                    if proc.returncode:
                        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
                    r = {"repeat": repeat, "every": every, "tensorboard": tb == "true",
                         **_median_of_windows(run_dir)}
                    results.append(r)
                    print(json.dumps(r), file=sys.stderr, flush=True)
    for every in args.every:
        on = [r for r in results if r["every"] == every and r["tensorboard"]]
        off = [r for r in results if r["every"] == every and not r["tensorboard"]]
        ratio = np.median([a["step_time_s"] / b["step_time_s"] for a, b in zip(on, off,
                                                                               strict=True)])
        print(f"every_steps={every}: step time on/off {ratio:.3f} (median of {len(on)} pairs); "
              f"on {np.median([r['step_time_s'] for r in on]):.4f} s, off "
              f"{np.median([r['step_time_s'] for r in off]):.4f} s; host_overhead_fraction on "
              f"{np.median([r['host_overhead_fraction'] for r in on]):.3f}, off "
              f"{np.median([r['host_overhead_fraction'] for r in off]):.3f}; host CPU per step "
              f"on {1e3 * np.median([r['host_cpu_s'] for r in on]):.2f} ms, off "
              f"{1e3 * np.median([r['host_cpu_s'] for r in off]):.2f} ms", file=sys.stderr)
    return results


def main() -> int:
    sys.path.insert(0, str(ROOT))  # this tree's maxmoe, not an installed one
    if sys.argv[1:2] == ["child"]:
        return child(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    lp = sub.add_parser("loop")
    lp.add_argument("config", nargs="?", default=str(ROOT / "configs" / "tiny.yaml"))
    lp.add_argument("--steps", type=int, default=40)
    lp.add_argument("--repeat", type=int, default=2)
    lp.add_argument("--every", type=int, nargs="+", default=[1, 10])
    lp.add_argument("--synthetic", action="store_true")
    sp = sub.add_parser("size")
    sp.add_argument("--records", type=int, default=50)
    args = p.parse_args()
    print(json.dumps(loop(args) if args.what == "loop" else size(args.records)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
