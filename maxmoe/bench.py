"""Benchmark the train step: compile once, warm up, time steps (`maxmoe bench` runs it).

`benchmark` / `benchmark_interleaved` return, per config, the compile time, step times,
tokens/s, model FLOPs per step, MFU against a stated peak (on CPU the host's matmul rate,
measured in the same run), XLA's compiled memory analysis per device and the kernel's share
(page faults, system CPU); maxmoe/commands/bench.py prints them.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import jax
import numpy as np

from maxmoe import malloc
from maxmoe.metrics.flops import (
    FLOP_CONVENTION,
    MFU_CONVENTION,
    fp8_params_per_token,
    fp8_peak_flops,
    mfu,
    peak_flops,
    peak_meter,
)
from maxmoe.metrics.profile import breakdown
from maxmoe.sharding import global_batch, use_mesh
from maxmoe.train.setup import prepare_run
from maxmoe.train.step import writes_metrics


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


def memory_line(memory: dict[str, int], fp8: str = "none") -> str:
    """The one-line account of memory_analysis' figures that `maxmoe bench` and `maxmoe train
    --dry-run` print: peak = arguments + outputs - aliased + temporaries, GiB per device.
    fp8 (precision.fp8) other than none adds what FP8 saves (FP8_MEMORY): kernels/fp8.py's
    fp8_dot keeps its input x for the backward in E4M3 under tensorwise (1 byte, not 2) and in
    bf16 under blockwise (the weight gradient's 128x1 token tiles differ from the forward's
    1x128); the routed experts keep bf16 inputs in both modes."""
    gib = 2.0**30
    line = (f"memory/device  peak {memory['peak_bytes'] / gib:.3f} GiB = arguments "
            f"{memory['argument_bytes'] / gib:.3f} + outputs {memory['output_bytes'] / gib:.3f} "
            f"- aliased {memory['alias_bytes'] / gib:.3f} + temporaries "
            f"{memory['temp_bytes'] / gib:.3f}")
    if fp8 != "none":
        line += f"; fp8 {fp8}: {FP8_MEMORY[fp8]}"
    return line


# what FP8 saves of the activations kept for the backward, per precision.fp8 mode
FP8_MEMORY = {
    "tensorwise": "projection and dense/shared MLP inputs kept for the backward in E4M3 (half "
                  "their bf16 bytes, where the remat policy keeps them); routed experts: none "
                  "saved",
    "blockwise": "none saved (bf16 activations kept for the backward)",
}


def benchmark(cfg, mesh_sizes, *, steps: int, warmup: int, profile_dir: str = "") -> dict:
    """The figures of one config (see module docstring); profile_dir adds a traced breakdown."""
    return benchmark_interleaved([(cfg, mesh_sizes)], steps=steps, warmup=warmup,
                                 profile_dir=profile_dir)[0]


def state_layout(trainer):
    """What decides whether two variants can share a train state: its tree, and every leaf's
    shape, dtype and sharding (hashable)."""
    abstract = trainer.abstract_state
    return jax.tree.structure(abstract), tuple(jax.tree.leaves(abstract))


def benchmark_interleaved(variants, *, steps: int, warmup: int,
                          profile_dir: str = "") -> list[dict]:
    """benchmark() of several (cfg, mesh_sizes) at once: all are compiled first, then timed in
    turns, one step of each per round, each variant first in turn, so a shared machine's load
    changes fall on every variant alike. Variants whose train state has the same shapes, dtypes
    and shardings share one state (each step takes the state the previous one returned), so a
    sweep holds one model in memory (`shared_state`: this variant took an earlier one's);
    the others keep their own. Each result adds `paired_ratio`, the median over rounds of its
    step time over the first variant's in the same round, and `step_times_s` in order."""
    runs = compile_variants(variants)
    meters = time_in_turns(runs, steps=steps, warmup=warmup)
    breakdown = None
    if profile_dir:
        # a profiled bench has one variant: its steps so far are warmup + steps
        breakdown = profile_unlogged(runs[0], warmup + steps, profile_dir)
    peaks = {}  # once per compute dtype
    base = np.asarray(runs[0]["times"])
    results = []
    for run in runs:
        dtype = run["setup"].cfg.precision.compute_dtype  # bfloat16 against a bfloat16 matmul
        peaks[dtype] = peaks.get(dtype) or peak_flops(run["setup"].cfg, meters[dtype])
        fp8_peak = fp8_peak_flops(run["setup"].cfg, peaks[dtype])
        results.append(result(run, base, steps, peaks[dtype], fp8_peak))
        if breakdown is not None and run is runs[0]:
            results[-1]["profile"] = breakdown
    return results


def compile_variants(variants) -> list[dict]:
    """One run (a dict) per (cfg, mesh_sizes): its RunSetup, compiled step, synthetic batch,
    state holder (shared between variants of one state layout), compile time and memory."""
    runs, shared = [], {}
    for cfg, sizes in variants:
        setup = prepare_run(cfg, sizes)
        trainer = setup.trainer
        key = state_layout(trainer)
        reuse = key in shared
        if not reuse:
            shared[key] = {"state": trainer.init()}
        batch = global_batch(synthetic_batch(cfg), trainer.batch_sharding)
        t = time.perf_counter()
        with use_mesh(trainer.mesh, trainer.rules):
            compiled = trainer.jitted_step.lower(shared[key]["state"], batch).compile()
        runs.append(dict(setup=setup, compiled=compiled, batch=batch,
                         holder=shared[key], compile_s=time.perf_counter() - t,
                         memory=memory_analysis(compiled), times=[], reuse=reuse,
                         faults=0, system_s=0.0))
    return runs


def run_step(run: dict) -> None:
    """One step of a run on its holder's state; waits for it."""
    trainer = run["setup"].trainer
    with use_mesh(trainer.mesh, trainer.rules):
        holder = run["holder"]
        holder["state"], run["metrics"] = run["compiled"](holder["state"], run["batch"])
        jax.block_until_ready(run["metrics"])


def time_in_turns(runs: list[dict], *, steps: int, warmup: int) -> dict:
    """`warmup` untimed rounds, then `steps` timed ones (each run first in turn), adding step
    times, page faults and system CPU to each run; returns {compute dtype: peak meter or None},
    each meter sampled once a round as well (see metrics.flops.MatmulPeak)."""
    meters = {}
    for run in runs:
        dtype = run["setup"].cfg.precision.compute_dtype
        if dtype not in meters:
            meters[dtype] = peak_meter(run["setup"].cfg)
    for _ in range(warmup):
        for run in runs:
            run_step(run)
    for i in range(steps):
        for run in runs[i % len(runs):] + runs[:i % len(runs)]:  # each goes first in turn
            before = resource.getrusage(resource.RUSAGE_SELF)  # all threads, XLA's included
            t = time.perf_counter()
            run_step(run)
            run["times"].append(time.perf_counter() - t)
            after = resource.getrusage(resource.RUSAGE_SELF)
            run["faults"] += after.ru_minflt - before.ru_minflt
            run["system_s"] += after.ru_stime - before.ru_stime
        for meter in meters.values():
            if meter is not None:
                meter.sample()
    return meters


def profile_unlogged(run: dict, done: int, profile_dir: str) -> dict[str, list[dict]]:
    """profile_steps of `run` after `done` steps, on steps the train loop would not log: a
    logged step (1 in logging.every_steps) also computes the update ratios and the param
    norm, three more passes over the params, and 1 traced step in 3 would weigh them 3x in
    the per-step breakdown."""
    for _ in range(unlogged_offset(done, run["setup"].cfg)):
        run_step(run)
    trainer = run["setup"].trainer
    with use_mesh(trainer.mesh, trainer.rules):
        return profile_steps(run["compiled"], run["holder"]["state"], run["batch"], profile_dir)


def mfu_figures(setup, step_time: float, peak: tuple[float, str],
                fp8_peak: tuple[float, str]) -> dict:
    """The MFU keys of a result: `mfu` (metrics.flops.MFU_CONVENTION: FP8-class FLOPs over
    the FP8 peak, the rest over the bf16 one), the FP8 class's FLOPs per step, and the total
    over each peak alone (mfu_vs_bf16_peak equals mfu when precision.fp8 is none)."""
    fp8 = 6.0 * fp8_params_per_token(setup.cfg) * setup.tokens_per_step
    flops = {"bf16": setup.model_flops - fp8, "fp8": fp8}
    return {"mfu": mfu(flops, step_time, {"bf16": peak[0], "fp8": fp8_peak[0]}),
            "mfu_convention": MFU_CONVENTION, "model_flops_fp8_per_step": fp8,
            "mfu_vs_bf16_peak": setup.model_flops / step_time / peak[0],
            "mfu_vs_fp8_peak": setup.model_flops / step_time / fp8_peak[0],
            "peak_flops": peak[0], "peak_source": peak[1],
            "peak_flops_fp8": fp8_peak[0], "peak_source_fp8": fp8_peak[1]}


def result(run: dict, base: np.ndarray, steps: int, peak: tuple[float, str] | None,
           fp8_peak: tuple[float, str] | None = None) -> dict:
    """A timed run's figures (module docstring); `base`: the first run's step times, for
    paired_ratio; `peak`: (FLOP/s, source) for its compute dtype, `fp8_peak` the FP8 one
    (default: `peak` again); peak None (an accelerator with no devices file): `mfu` None."""
    setup, times, metrics = run["setup"], np.asarray(run["times"]), run["metrics"]
    step_time = float(np.median(times))
    return {
        "tokens_per_second": setup.tokens_per_step / step_time, "step_time_s": step_time,
        "step_time_min_s": float(np.min(times)), "step_time_max_s": float(np.max(times)),
        "paired_ratio": float(np.median(times / base)), "step_times_s": times.tolist(),
        "shared_state": run["reuse"],
        "model_flops_per_step": setup.model_flops, "flop_convention": FLOP_CONVENTION,
        **(mfu_figures(setup, step_time, peak, fp8_peak or peak) if peak is not None else
           {"mfu": None, "peak_flops": None, "peak_source": "none: MFU left out (see the "
                                                             "warning above)"}),
        "precision_fp8": setup.cfg.precision.fp8, "compile_time_s": run["compile_s"],
        "devices": jax.device_count(), "allocator": malloc.in_use(),
        # the kernel's share: page faults and system CPU time a timed step (malloc.py)
        "minor_faults_per_step": run["faults"] / steps,
        "system_cpu_s_per_step": run["system_s"] / steps,
        "mesh": setup.mesh_shape,
        "loss": float(metrics["loss"]),
        "dropped_fraction": float(metrics.get("dropped_fraction", 0.0)),
        "dispatch_rounds": float(metrics.get("dispatch_rounds", 0.0)), **run["memory"],
        **device_peak_bytes(),
    }


def device_peak_bytes() -> dict[str, int]:
    """{"device_peak_bytes": the most memory the first device has held so far in this process}
    where the backend reports it (GPU), else {}: what was really allocated, next to XLA's
    compile-time estimate. It never resets, so compare variants in separate processes."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" not in stats:
        return {}
    return {"device_peak_bytes": int(stats["peak_bytes_in_use"])}


PROFILE_STEPS = 3


def unlogged_offset(done: int, cfg) -> int:
    """How many steps to run after `done` so that the next PROFILE_STEPS are not logged
    (0 if every window of them has a logged step)."""
    for skip in range(cfg.logging.every_steps):
        if not any(writes_metrics(done + skip + i, cfg) for i in range(1, PROFILE_STEPS + 1)):
            return skip
    return 0


def profile_steps(compiled, state, batch, directory: str) -> dict[str, list[dict]]:
    """Traces PROFILE_STEPS steps into `directory`; returns metrics.profile.breakdown rows and
    `traced_step_ms`, the wall time per traced step (what the parts add up to)."""
    jax.profiler.start_trace(directory)
    try:
        t = time.perf_counter()
        for _ in range(PROFILE_STEPS):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        wall_ms = (time.perf_counter() - t) * 1e3 / PROFILE_STEPS
    finally:
        jax.profiler.stop_trace()
    hlo = compiled.as_text()
    (Path(directory) / "train_step.hlo.txt").write_text(hlo)  # op names for reading the trace
    return {**breakdown(directory, hlo, PROFILE_STEPS), "traced_step_ms": wall_ms}
