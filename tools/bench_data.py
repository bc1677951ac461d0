"""Data benchmarks: prepare throughput and packed-token loader throughput on this machine.

    python tools/bench_data.py                    # all figures, about 2-3 minutes on 2 cores
    python tools/bench_data.py --prepare-megabytes 8 --batches 20   # quicker

Prepares this interpreter's standard-library sources (on every machine) with the cached
stdlib tokenizer, then times the grain loader over the prepared shards (and over raw text,
tokenized on the fly) for two shapes with 0 and 2 worker processes. Prints one line a figure
and a JSON summary at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# Training-side consumption, for comparison. Tiny: the fastest logging window measured on
# this 2-core CPU with `maxmoe train configs/tiny.yaml train.steps=20` on prepared stdlib
# shards (8 fake devices; 2358-3153 tokens/s). Mid-size: estimate for a GPU host,
# 8 x H100 at 40% MFU of its bf16 peak (configs/devices/h100.yaml), 6 x 1e9 active-parameter
# FLOPs a token.
TINY_TRAIN_TOKENS_PER_SECOND = 3200.0


def mid_train_tokens_per_second_per_host() -> float:
    from maxmoe.cluster import load_device_kind

    return 8 * 0.4 * load_device_kind("h100")[0]["peak_bf16_flops"] / (6 * 1e9)


def _prepare_figures(workdir: str, megabytes: float, workers: int) -> tuple[str, dict]:
    from maxmoe.config import DataConfig
    from maxmoe.data.corpus import list_documents
    from maxmoe.data.executors import LaunchOptions
    from maxmoe.data.prepare import PrepareOptions, prepare
    from maxmoe.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(DataConfig(source="stdlib"), 2048)
    files, size = [], 0
    for path in list_documents("stdlib"):
        files.append(path)
        size += os.path.getsize(path)
        if size >= megabytes * 1e6:
            break
    out = os.path.join(workdir, f"stdlib-{workers}")
    # datatrove's local executor: `workers` tasks at once, four tasks a worker
    options = PrepareOptions(tasks=4 * workers, launch=LaunchOptions(workers=workers))
    start = time.perf_counter()
    manifest = prepare(files, os.path.dirname(tokenizer.path), out, options)
    seconds = time.perf_counter() - start
    figures = {"files": len(files), "megabytes": size / 1e6, "seconds": seconds,
               "megabytes_per_second": size / 1e6 / seconds,
               "tokens_written": sum(manifest["tokens_written"].values()),
               "dropped": manifest["dropped"], "read_errors": manifest["read_errors"]}
    print(f"prepare stdlib, {workers} worker(s): {size / 1e6:.1f} MB in {seconds:.1f} s = "
          f"{figures['megabytes_per_second']:.2f} MB/s raw text "
          f"({figures['tokens_written']} tokens, dropped {manifest['dropped']})", flush=True)
    return out, figures


def _loader_tokens_per_second(source: str, seq_len: int, batch: int, workers: int,
                              batches: int) -> float:
    from maxmoe.config import DataConfig
    from maxmoe.data.pipeline import make_dataset
    from maxmoe.data.tokenizer import load_tokenizer

    cfg = DataConfig(source=source, seq_len=seq_len, global_batch_size=batch,
                     num_workers=workers)
    tokenizer = load_tokenizer(cfg, 2048)
    iterator = iter(make_dataset(cfg, tokenizer))
    next(iterator)  # start-up (worker spawn, first reads) is not steady-state throughput
    start = time.perf_counter()
    real = 0
    for _ in range(batches):
        real += int((next(iterator)["segment_ids"] > 0).sum())
    return real / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare-megabytes", type=float, default=32.0,
                        help="raw text to prepare (default: the whole stdlib, about 31 MB)")
    parser.add_argument("--batches", type=int, default=50, help="timed batches a measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args()
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags
    summary: dict = {"cpu_cores": len(os.sched_getaffinity(0))}
    with tempfile.TemporaryDirectory() as workdir:
        summary["prepare"] = {}
        prepared = None
        for workers in (1, len(os.sched_getaffinity(0))):
            prepared, figures = _prepare_figures(workdir, args.prepare_megabytes, workers)
            summary["prepare"][f"workers_{workers}"] = figures
        summary["loader"] = {}
        shapes = {"seq128_batch16": (128, 16), "seq2048_batch32": (2048, 32)}
        needs = {"seq128_batch16": TINY_TRAIN_TOKENS_PER_SECOND,
                 "seq2048_batch32": mid_train_tokens_per_second_per_host()}
        for name, (seq_len, batch) in shapes.items():
            # fewer timed batches for the big shape: each holds 16x the tokens
            count = max(20, args.batches // (4 if seq_len > 1024 else 1))
            for kind, source in (("prepared", prepared), ("raw_stdlib", "stdlib")):
                for workers in args.workers:
                    rate = _loader_tokens_per_second(source, seq_len, batch, workers, count)
                    key = f"{name}/{kind}/workers_{workers}"
                    summary["loader"][key] = rate
                    print(f"loader {key}: {rate:,.0f} packed tokens/s "
                          f"(training needs {needs[name]:,.0f}: x{rate / needs[name]:.1f})",
                          flush=True)
    summary["training_tokens_per_second"] = {
        "tiny_cpu_measured": TINY_TRAIN_TOKENS_PER_SECOND,
        "mid_gpu_host_estimate": mid_train_tokens_per_second_per_host()}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
