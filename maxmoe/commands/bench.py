"""`maxmoe bench CONFIG... [KEY=VALUE...]`: compile once, warm up, time N train steps.

Prints compile time, median step time, tokens/s, model FLOPs per step, MFU against a stated
peak (on CPU the host's float32 matmul rate, measured in the same run), XLA's compiled memory
analysis per device, and as the last line one JSON object for scripts. The timing itself is
maxmoe/bench.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from maxmoe.commands.setup import configure

USAGE = """\
Benchmark the train step of a config (same CONFIG/KEY=VALUE arguments as `maxmoe train`).
Batches are synthetic packed rows (uniform random tokens, 4 documents per row), so the figures
measure the step alone, not the data pipeline. Example:

  maxmoe bench configs/bench/cpu_mixtral_tiny.yaml --steps 10
  maxmoe bench configs/tiny.yaml moe.dispatch=capacity mesh.expert=4 mesh.fsdp=1
  maxmoe bench configs/tiny.yaml --sweep model.remat_policy=none,full,dots,save_named,offload_named

--sweep KEY=V1,V2,... compiles every value, then times them in turns (one step of each per
round, so a shared machine's load changes fall on all alike) and prints one table: median step
time, its ratio to the first value (median over rounds of the two steps' ratio), MFU and the
compiled memory per device: arguments, outputs, temporaries, peak, and host-memory bytes."""


def positive_int(text: str) -> int:
    """argparse type for --steps: a whole number of at least 1, else a one-line usage error."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time the train step (tokens/s, MFU, memory)",
                              description=USAGE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="+", metavar="CONFIG_OR_KEY=VALUE")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compile (default 2)")
    p.add_argument("--sweep", metavar="KEY=V1,V2,...", default="",
                   help="benchmark each value of one config key; print a comparison table")
    p.add_argument("--profile", metavar="DIR", default="",
                   help="after timing, trace 3 steps with jax.profiler into DIR and print where "
                        "the time goes, per model part (forward/backward, matmul share)")
    p.set_defaults(run=run)


def sweep_table(key: str, rows: list[tuple[str, dict]]) -> str:
    """One line per swept value: median step time, its paired ratio to the first value (median
    over rounds, see benchmark_interleaved), MFU, memory per device in MiB; where a value runs
    FP8 GEMMs, tokens/s and MFU against the bf16 and the fp8 peak alone too."""
    mib = 2.0 ** 20
    fp8 = any(r["precision_fp8"] != "none" for _, r in rows)
    lines = [f"{key:<20} {'step ms':>9} {'ratio':>6} {'MFU':>6} {'args MiB':>9} {'out MiB':>9} "
             f"{'temp MiB':>9} {'peak MiB':>9} {'host MiB':>9}"
             + (f" {'tokens/s':>9} {'MFU bf16':>8} {'MFU fp8':>8}" if fp8 else "")]
    for value, r in rows:
        host = r.get("host_argument_bytes", 0) + r.get("host_output_bytes", 0) + r.get(
            "host_temp_bytes", 0)
        ms, ratio = 1e3 * r["step_time_s"], r["paired_ratio"]
        mfu = f"{100 * r['mfu']:>5.1f}%" if r["mfu"] is not None else f"{'-':>6}"
        lines.append(f"{value:<20} {ms:>9.1f} {ratio:>6.3f} {mfu} "
                     + " ".join(f"{r.get(k, 0) / mib:>9.2f}" for k in (
                         "argument_bytes", "output_bytes", "temp_bytes", "peak_bytes"))
                     + f" {host / mib:>9.2f}"
                     + (f" {r['tokens_per_second']:>9.0f} {100 * r['mfu_vs_bf16_peak']:>7.1f}% "
                        f"{100 * r['mfu_vs_fp8_peak']:>7.1f}%" if fp8 and r["mfu"] is not None
                        else ""))
    return "\n".join(lines)


def run_sweep(args) -> int:
    """--sweep KEY=V1,V2,...: every value checked, then all timed in turns; one table."""
    key, _, values = args.sweep.partition("=")
    if not key or not values:
        print("maxmoe: error: --sweep expects KEY=V1,V2,... e.g. model.remat_policy=none,full",
              file=sys.stderr)
        return 2
    if args.profile:
        print("maxmoe: error: --profile traces one config, --sweep times several; profile a "
              f"value on its own, e.g. `maxmoe bench ... {key}={values.split(',')[0]} --profile "
              f"{args.profile}`", file=sys.stderr)
        return 2
    values = values.split(",")
    variants = [configure([*args.items, f"{key}={value}"]) for value in values]  # all checked first
    from maxmoe.bench import benchmark_interleaved  # late: imports JAX; keeps --help free of it

    results = benchmark_interleaved(variants, steps=args.steps, warmup=args.warmup)
    rows = list(zip(values, results, strict=True))
    print(sweep_table(key, rows), file=sys.stderr)
    print(json.dumps({value: r for value, r in rows}))
    return 0


def mfu_lines(r: dict) -> list[str]:
    """The MFU line of a bench result; with precision.fp8 on, the class split and the total
    over each peak alone on a second line (metrics.flops.MFU_CONVENTION)."""
    if r["mfu"] is None:
        return [f"MFU            left out: no peak ({r['peak_source']})"]
    line = f"MFU            {100 * r['mfu']:.1f}% of {r['peak_flops']:.3e} FLOP/s ({r['peak_source']})"
    if r["precision_fp8"] == "none":
        return [line]
    share = r["model_flops_fp8_per_step"] / r["model_flops_per_step"]
    return [f"MFU            {100 * r['mfu']:.1f}% per matmul class: {100 * share:.1f}% of "
            f"the FLOPs fp8 {r['precision_fp8']} at {r['peak_flops_fp8']:.3e} FLOP/s "
            f"({r['peak_source_fp8']}), the rest at {r['peak_flops']:.3e} ({r['peak_source']})",
            f"               {100 * r['mfu_vs_bf16_peak']:.1f}% of the bf16 peak alone, "
            f"{100 * r['mfu_vs_fp8_peak']:.1f}% of the fp8 peak alone"]


def run(args) -> int:
    """Times one config (or a --sweep); prints the figures, then one JSON line. Exit 0."""
    if args.sweep:
        return run_sweep(args)
    cfg, sizes = configure(args.items)
    # late: these import JAX; keeps `maxmoe --help` free of it
    from maxmoe.bench import PROFILE_STEPS, benchmark, memory_line
    from maxmoe.metrics.profile import table
    from maxmoe.model.spec import describe_pipeline
    from maxmoe.parallel.dispatch import describe_transport

    r = benchmark(cfg, sizes, steps=args.steps, warmup=args.warmup, profile_dir=args.profile)
    gib = 2.0 ** 30
    lines = [
        f"mesh           {r['mesh'] or '1 device'} ({r['devices']} devices)",
        f"host           {r['allocator']} malloc: {r['minor_faults_per_step']:.0f} page faults and "
        f"{1e3 * r['system_cpu_s_per_step']:.1f} ms of system CPU a step",
        f"compile        {r['compile_time_s']:.1f} s",
        f"step time      {1e3 * r['step_time_s']:.1f} ms median of {args.steps} "
        f"(min {1e3 * r['step_time_min_s']:.1f}, max {1e3 * r['step_time_max_s']:.1f})",
        f"tokens/s       {r['tokens_per_second']:.0f}",
        f"model FLOPs    {r['model_flops_per_step']:.3e} per step ({r['flop_convention']})",
        *mfu_lines(r),
    ]
    if "peak_bytes" in r:
        lines.append(memory_line(r, r["precision_fp8"]))
    if "device_peak_bytes" in r:
        lines.append(f"device peak    {r['device_peak_bytes'] / gib:.3f} GiB in use at most "
                     "(the device's own count)")
    lines += [line for line in (describe_pipeline(cfg.model, sizes["pipeline"]),
                                describe_transport(cfg, sizes)) if line]
    if "profile" in r:
        lines += [f"profile        {PROFILE_STEPS} unlogged steps traced into {args.profile} "
                  "(TensorBoard/Perfetto); time per step by part:", table(r["profile"])]
    print("\n".join(lines), file=sys.stderr)
    print(json.dumps(r))
    return 0
