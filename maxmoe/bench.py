"""`maxmoe bench CONFIG... [KEY=VALUE...]`: compile once, warm up, time N train steps.

Prints compile time, median step time, tokens/s, model FLOPs per step, MFU against a stated
peak (on CPU the host's float32 matmul rate, measured in the same run), XLA's compiled memory
analysis per device, and as the last line one JSON object for scripts.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

from maxmoe import malloc

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
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="time the train step (tokens/s, MFU, memory)",
                       description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="+", metavar="CONFIG_OR_KEY=VALUE")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compile (default 2)")
    p.add_argument("--sweep", metavar="KEY=V1,V2,...", default="",
                   help="benchmark each value of one config key; print a comparison table")
    p.add_argument("--profile", metavar="DIR", default="",
                   help="after timing, trace 3 steps with jax.profiler into DIR and print where "
                        "the time goes, per model part (forward/backward, matmul share)")
    p.set_defaults(run=run)


def synthetic_batch(cfg, seed: int = 0) -> dict[str, np.ndarray]:
    """Global batch of packed rows: 4 equal documents per row, random tokens."""
    rng = np.random.default_rng(seed)
    b, s = cfg.data.global_batch_size, cfg.data.seq_len
    doc = max(s // 4, 1)
    segment_ids = (np.arange(s) // doc + 1).astype(np.int32)
    positions = (np.arange(s) % doc).astype(np.int32)
    tokens = rng.integers(1, cfg.model.vocab_size, (b, s + 1)).astype(np.int32)
    return dict(tokens=tokens[:, :-1], targets=tokens[:, 1:],
                segment_ids=np.broadcast_to(segment_ids, (b, s)).copy(),
                positions=np.broadcast_to(positions, (b, s)).copy(),
                loss_mask=np.ones((b, s), np.float32))


def memory_analysis(compiled) -> dict[str, int]:
    """Bytes per device from XLA's compiled memory analysis (what each buffer class needs)."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    fields = {"argument_bytes": "argument_size_in_bytes", "output_bytes": "output_size_in_bytes",
              "temp_bytes": "temp_size_in_bytes", "alias_bytes": "alias_size_in_bytes",
              "generated_code_bytes": "generated_code_size_in_bytes",
              "host_temp_bytes": "host_temp_size_in_bytes",
              "host_argument_bytes": "host_argument_size_in_bytes",
              "host_output_bytes": "host_output_size_in_bytes"}
    out = {k: int(getattr(m, v, 0) or 0) for k, v in fields.items()}
    # donated arguments alias outputs: the live peak is arguments + outputs - aliased + temps
    out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                         + out["temp_bytes"])
    return out


def benchmark(cfg, mesh_sizes, *, steps: int, warmup: int, profile_dir: str = "") -> dict:
    """The figures of one config (see module docstring); profile_dir adds a traced breakdown."""
    return benchmark_interleaved([(cfg, mesh_sizes)], steps=steps, warmup=warmup,
                                 profile_dir=profile_dir)[0]


def state_layout(trainer):
    """What decides whether two variants can share a train state: its tree, and every leaf's
    shape, dtype and sharding (hashable)."""
    import jax

    abstract = trainer.abstract_state
    return jax.tree.structure(abstract), tuple(jax.tree.leaves(abstract))


def benchmark_interleaved(variants, *, steps: int, warmup: int,
                          profile_dir: str = "") -> list[dict]:
    """benchmark() of several (cfg, mesh_sizes) at once: all are compiled first, then timed in
    turns, one step of each per round, each variant first in turn. A shared machine's load
    changes (which moved a 10-step median by 10-20% between back-to-back runs, issue 8) so fall
    on every variant alike. Variants whose train state has the same shapes, dtypes and
    shardings share one state (each step takes the state the previous one returned), so a
    sweep holds one model in memory (`shared_state`: this variant took an earlier one's);
    the others keep their own. Each result adds `paired_ratio`, the median over rounds of its
    step time over the first variant's in the same round, and `step_times_s` in order."""
    import jax

    from maxmoe.validation import dcn_sizes
    from maxmoe.metrics.flops import flops_per_token, peak_flops, peak_meter
    from maxmoe.sharding import global_batch, make_mesh, use_mesh
    from maxmoe.train.step import make_trainer

    runs, shared = [], {}
    for cfg, sizes in variants:
        trainer = make_trainer(cfg, make_mesh(sizes, dcn=dcn_sizes(cfg)))
        key = state_layout(trainer)
        reuse = key in shared
        if not reuse:
            shared[key] = {"state": trainer.init()}
        batch = global_batch(synthetic_batch(cfg), trainer.batch_sharding)
        t = time.perf_counter()
        with use_mesh(trainer.mesh, trainer.rules):
            compiled = trainer.jitted_step.lower(shared[key]["state"], batch).compile()
        runs.append(dict(cfg=cfg, sizes=sizes, trainer=trainer, compiled=compiled, batch=batch,
                         holder=shared[key], compile_s=time.perf_counter() - t,
                         memory=memory_analysis(compiled), times=[], reuse=reuse,
                         faults=0, system_s=0.0))

    def step(run):
        with use_mesh(run["trainer"].mesh, run["trainer"].rules):
            holder = run["holder"]
            holder["state"], run["metrics"] = run["compiled"](holder["state"], run["batch"])
            jax.block_until_ready(run["metrics"])

    # a measured peak (CPU) is sampled once a round as well: see metrics.flops.MatmulPeak
    meters = {}
    for run in runs:
        dtype = run["cfg"].precision.compute_dtype
        if dtype not in meters:
            meters[dtype] = peak_meter(run["cfg"])
    for _ in range(warmup):
        for run in runs:
            step(run)
    for i in range(steps):
        for run in runs[i % len(runs):] + runs[:i % len(runs)]:  # each goes first in turn
            before = resource.getrusage(resource.RUSAGE_SELF)  # all threads, XLA's included
            t = time.perf_counter()
            step(run)
            run["times"].append(time.perf_counter() - t)
            after = resource.getrusage(resource.RUSAGE_SELF)
            run["faults"] += after.ru_minflt - before.ru_minflt
            run["system_s"] += after.ru_stime - before.ru_stime
        for meter in meters.values():
            if meter is not None:
                meter.sample()
    breakdown = None
    if profile_dir:
        run = runs[0]
        # trace steps the train loop would not log: a logged step (1 in logging.every_steps)
        # also computes the update ratios and the param norm, three more passes over the
        # params, and 1 traced step in 3 would weigh them 3x in the per-step breakdown
        done = warmup + steps  # a profiled bench has one variant: its steps so far
        for _ in range(unlogged_offset(done, run["cfg"])):
            step(run)
        with use_mesh(run["trainer"].mesh, run["trainer"].rules):
            breakdown = profile_steps(run["compiled"], run["holder"]["state"], run["batch"],
                                      profile_dir)
    peaks = {}  # once per compute dtype
    base = np.asarray(runs[0]["times"])
    results = []
    for run in runs:
        cfg, times, metrics = run["cfg"], np.asarray(run["times"]), run["metrics"]
        step_time = float(np.median(times))
        tokens = cfg.data.global_batch_size * cfg.data.seq_len
        model_flops = flops_per_token(cfg) * tokens
        dtype = cfg.precision.compute_dtype  # a bfloat16 run against a bfloat16 matmul
        peak, peak_source = peaks[dtype] = peaks.get(dtype) or peak_flops(cfg, meters[dtype])
        results.append({
            "tokens_per_second": tokens / step_time, "step_time_s": step_time,
            "step_time_min_s": float(np.min(times)), "step_time_max_s": float(np.max(times)),
            "paired_ratio": float(np.median(times / base)), "step_times_s": times.tolist(),
            "shared_state": run["reuse"],
            "model_flops_per_step": model_flops, "mfu": model_flops / step_time / peak,
            "peak_flops": peak, "peak_source": peak_source, "compile_time_s": run["compile_s"],
            "devices": jax.device_count(), "allocator": malloc.in_use(),
            # the kernel's share: page faults and system CPU time a timed step (malloc.py)
            "minor_faults_per_step": run["faults"] / steps,
            "system_cpu_s_per_step": run["system_s"] / steps,
            "mesh": {k: v for k, v in run["sizes"].items() if v > 1},
            "loss": float(metrics["loss"]),
            "dropped_fraction": float(metrics.get("dropped_fraction", 0.0)), **run["memory"],
            **({"profile": breakdown} if breakdown is not None and run is runs[0] else {}),
        })
    return results


PROFILE_STEPS = 3


def unlogged_offset(done: int, cfg) -> int:
    """How many steps to run after `done` so that the next PROFILE_STEPS are not logged
    (0 if every window of them has a logged step)."""
    from maxmoe.train.step import writes_metrics

    for skip in range(cfg.logging.every_steps):
        if not any(writes_metrics(done + skip + i, cfg) for i in range(1, PROFILE_STEPS + 1)):
            return skip
    return 0


def profile_steps(compiled, state, batch, directory: str) -> dict[str, list[dict]]:
    """Traces PROFILE_STEPS steps into `directory`; returns metrics.profile.breakdown rows."""
    import jax

    from maxmoe.metrics.profile import breakdown

    jax.profiler.start_trace(directory)
    try:
        for _ in range(PROFILE_STEPS):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
    finally:
        jax.profiler.stop_trace()
    hlo = compiled.as_text()
    (Path(directory) / "train_step.hlo.txt").write_text(hlo)  # op names for reading the trace
    return breakdown(directory, hlo, PROFILE_STEPS)


def sweep_table(key: str, rows: list[tuple[str, dict]]) -> str:
    """One line per swept value: median step time, its paired ratio to the first value (median
    over rounds, see benchmark_interleaved), MFU, memory per device in MiB."""
    mib = 2.0 ** 20
    lines = [f"{key:<20} {'step ms':>9} {'ratio':>6} {'MFU':>6} {'args MiB':>9} {'out MiB':>9} "
             f"{'temp MiB':>9} {'peak MiB':>9} {'host MiB':>9}"]
    for value, r in rows:
        host = r.get("host_argument_bytes", 0) + r.get("host_output_bytes", 0) + r.get(
            "host_temp_bytes", 0)
        ms, ratio = 1e3 * r["step_time_s"], r["paired_ratio"]
        lines.append(f"{value:<20} {ms:>9.1f} {ratio:>6.3f} {100 * r['mfu']:>5.1f}% "
                     + " ".join(f"{r.get(k, 0) / mib:>9.2f}" for k in (
                         "argument_bytes", "output_bytes", "temp_bytes", "peak_bytes"))
                     + f" {host / mib:>9.2f}")
    return "\n".join(lines)


def run_sweep(args) -> int:
    from maxmoe.cli import prepare

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
    variants = [prepare([*args.items, f"{key}={value}"]) for value in values]  # all checked first
    results = benchmark_interleaved(variants, steps=args.steps, warmup=args.warmup)
    rows = list(zip(values, results))
    print(sweep_table(key, rows), file=sys.stderr)
    print(json.dumps({value: r for value, r in rows}))
    return 0


def run(args) -> int:
    from maxmoe.cli import prepare

    if args.sweep:
        return run_sweep(args)
    cfg, sizes = prepare(args.items)
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
        f"model FLOPs    {r['model_flops_per_step']:.3e} per step",
        f"MFU            {100 * r['mfu']:.1f}% of {r['peak_flops']:.3e} FLOP/s ({r['peak_source']})",
    ]
    if "peak_bytes" in r:
        lines.append(f"memory/device  peak {r['peak_bytes'] / gib:.3f} GiB = arguments "
                     f"{r['argument_bytes'] / gib:.3f} + outputs {r['output_bytes'] / gib:.3f} "
                     f"- aliased {r['alias_bytes'] / gib:.3f} + temporaries {r['temp_bytes'] / gib:.3f}")
    from maxmoe.model.spec import describe_pipeline

    pipeline_line = describe_pipeline(cfg.model, sizes["pipeline"])
    if pipeline_line:
        lines.append(pipeline_line)
    if "profile" in r:
        from maxmoe.metrics.profile import table

        lines += [f"profile        {PROFILE_STEPS} unlogged steps traced into {args.profile} "
                  "(TensorBoard/Perfetto); time per step by part:", table(r["profile"])]
    print("\n".join(lines), file=sys.stderr)
    print(json.dumps(r))
    return 0
