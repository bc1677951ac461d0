"""`maxmoe plan`'s flow: load the config and the cluster, choose the layouts (the config's own,
or --search's best), compile each in its own process, and print the figures."""

from __future__ import annotations

import dataclasses
import math
from typing import TextIO

from maxmoe.cluster import Cluster, gpu_target, load_cluster
from maxmoe.config import ConfigError
from maxmoe.config_files import load_config
from maxmoe.plan import gpu_aot, search
from maxmoe.plan.collectives import CommBytes, summarize
from maxmoe.plan.compiled_flops import check_line
from maxmoe.plan.overlap import overlap_line
from maxmoe.plan.probe import COMPILERS, GPU_STAND_INS, ProbeFailed, run_probe
from maxmoe.plan.report import GIB, mesh_text, plan_figures, table, write_config
from maxmoe.plan.roofline import parse_tokens
from maxmoe.validation import validate


def plan(items: list[str], cluster_spec: str, *, tokens: str = "", search_layouts: bool = False,
         top: int = 4, write: str = "", timeout_s: float = 900, compiler: str = "auto",
         ignore_memory: bool = False, load_imbalance: float | None = None,
         out: TextIO) -> dict:
    """Plans `items` (config files and KEY=VALUE overrides) on the cluster, compiling with
    XLA:CPU on fake devices or XLA:GPU on deviceless GPUs (`compiler`, probe.py; "auto":
    resolve_compiler); returns
    {"rows": figures of every compiled layout, best first, "best": rows[0]}. Raises
    ConfigError on bad input (a kind without a GPU target, no CUDA plugin), before any
    compile. ignore_memory: --search ranks and orders every layout by step time alone.
    load_imbalance: the busiest expert shard over the mean (default
    roofline.DEFAULT_LOAD_IMBALANCE), slowing the dispatch and the routed experts."""
    if load_imbalance is not None and not load_imbalance >= 1:
        raise ConfigError(f"--load-imbalance {load_imbalance}: must be at least 1 (the busiest "
                          "expert shard's tokens over the mean); write e.g. 1.1")
    files = [a for a in items if "=" not in a]
    overrides = [a for a in items if "=" in a]
    cfg, origins = load_config(files, overrides)
    cluster = load_cluster(cluster_spec)
    token_count = parse_tokens(tokens) if tokens else None
    compiler = resolve_compiler(compiler, cluster, out)
    check_compiler(compiler, cluster)
    print(f"plan: {', '.join(files)} on {cluster.name} ({cluster.devices} x {cluster.kind}, "
          f"{cluster.hosts} hosts of {cluster.devices_per_host}; {cluster.memory_gib:.1f} GiB, "
          f"{cluster.usable_bytes / GIB:.1f} GiB usable per device)", file=out)
    if search_layouts:
        layouts = search.ranked(cfg, origins, cluster)
        if ignore_memory:
            layouts = layouts.ignoring_memory()
        if not layouts.fitting:
            raise ConfigError(fits_nowhere(cfg, origins, cluster, len(layouts.all)))
        print(f"search: {len(layouts.all)} layouts pass validation; {len(layouts.fitting)} fit "
              f"by the analytic estimate; compiling the best {min(top, len(layouts.fitting))}",
              file=out)
        candidates = [(overrides + e.layout.overrides(), e) for e in layouts.to_compile(top)]
    else:
        validate(cfg, cluster.devices, origins, cluster.hosts)  # one line, before compiling
        candidates = [(overrides, None)]
    rows = []
    for extra, estimate in candidates:
        measured = compile_layout(files + extra, cluster, timeout_s, out, compiler,
                                  load_imbalance)
        if measured is None:
            continue
        figures = plan_figures(measured, cluster, tokens=token_count, steps=cfg.train.steps,
                               load_imbalance=load_imbalance)
        figures.update(layout=extra[len(overrides):], remat=measured["remat"],
                       microbatches=measured["microbatches"])
        if estimate is not None:
            figures["estimated_peak_bytes"] = estimate.peak
        rows.append(figures)
    if not rows:
        raise ConfigError(f"no layout of {', '.join(files)} compiled on {cluster.name}; see the "
                          "lines above")
    rows.sort(key=lambda r: (not (r["fits"] or ignore_memory), r["step_time_s"]))
    print(table(rows), file=out)
    describe(rows[0], cluster, out)
    if write:
        best_cfg, _ = load_config(files, overrides + rows[0]["layout"])
        write_config(write, best_cfg, rows[0], cluster)
        print(f"wrote {write}: pass it after the model config", file=out)
    return {"rows": rows, "best": rows[0]}


def resolve_compiler(compiler: str, cluster: Cluster, out: TextIO) -> str:
    """`compiler`, with "auto" resolved: "gpu" where jax's CUDA plugin is installed and the
    cluster's kind is an NVIDIA GPU with a gpu_target in configs/devices/, else "cpu", saying in
    one line (for a GPU cluster) that the figures come from XLA:CPU's stand-ins."""
    if compiler != "auto":
        return compiler
    target = gpu_target(cluster.kind)
    nvidia = target is not None and target["device_name"].startswith("NVIDIA")
    if nvidia and gpu_aot.plugin_installed():
        return "gpu"
    if cluster.kind != "cpu":
        why = ("no jax CUDA plugin here (pip install -e \".[cuda]\")" if nvidia else
               f"{cluster.kind} has no NVIDIA gpu_target in configs/devices/")
        print(f"plan: --compiler auto -> cpu ({why}): the figures come from XLA:CPU on fake "
              "devices, with CPU stand-ins for the GPU's kernels", file=out)
    return "cpu"


def check_compiler(compiler: str, cluster: Cluster) -> None:
    """ConfigError unless `compiler` can compile for the cluster here: "cpu" always; "gpu"
    needs a GPU target for the cluster's kind and jax's CUDA plugin installed."""
    if compiler not in COMPILERS:
        raise ConfigError(f"--compiler {compiler!r}: unknown; use one of auto, "
                          f"{', '.join(COMPILERS)}")
    if compiler == "gpu":
        gpu_aot.require_target(cluster.kind)
        gpu_aot.require_plugin()


def compile_layout(items: list[str], cluster: Cluster, timeout_s: float, out: TextIO,
                   compiler: str = "cpu", load_imbalance: float | None = None) -> dict | None:
    """probe.run_probe on the cluster's device count (and, for XLA:GPU's schedule, the cluster
    and load imbalance); a failed compile prints one line and returns None (an invalid layout
    raises ConfigError)."""
    try:
        return run_probe(items, cluster.devices, cluster.hosts, cluster.devices_per_host,
                         timeout_s, compiler, cluster.kind, cluster, load_imbalance)
    except ProbeFailed as e:
        print(f"plan: skipped a layout: {e}", file=out)
        return None


def fp8_text(best: dict) -> str:
    """The MFU note " (fp8: N FLOPs a step at the fp8 peak, ...)" of a plan whose FP8 class has
    FLOPs (metrics.flops.MFU_CONVENTION), else "" (precision.fp8 none)."""
    fp8 = best.get("model_flops_fp8_per_step", 0.0)
    if not fp8:
        return ""
    return (f" (fp8: {fp8:.3e} FLOPs a step at the fp8 peak, the rest at the bf16 one; "
            f"effective peak {best['mfu_peak_flops_per_device']:.3e} FLOP/s a device)")


def describe(best: dict, cluster: Cluster, out: TextIO, title: str = "best") -> None:
    """The best layout's figures in words: memory by part, buffers, replication, traffic, time,
    cost. `title` heads them (the dry run's figures are its own layout's, on real devices)."""
    m = best["memory_by_part"]
    say = lambda text: print(text, file=out)  # noqa: E731
    say(f"\n{title}: {mesh_text(best['mesh'])}, weights {best.get('weights', 'zero3')}, "
        f"remat {best['remat']}, "
        f"{best['microbatches']} microbatch(es); compiled in {best['compile_s']} s "
        f"({best['wall_s']} s with its process)")
    if best.get("compiler") == "gpu" or best["stand_ins"]:  # a dry run compiles the real kernels
        say("  " + compiler_text(best))
    verdict = "fits" if best["fits"] else "does NOT fit"
    say(f"  memory per device: parameters {m['parameters'] / GIB:.2f} GiB, optimizer state "
        f"{m['optimizer_state'] / GIB:.2f} GiB, batch {m['batch'] / GIB:.3f} GiB; temporaries "
        f"{m['temporaries'] / GIB:.2f} GiB (gradients {m['gradients'] / GIB:.2f} GiB, "
        f"activations and the rest {m['activations_and_other_temporaries'] / GIB:.2f} GiB); "
        f"peak {best['peak_bytes_per_device'] / GIB:.2f} GiB of "
        f"{best['usable_bytes_per_device'] / GIB:.1f} GiB usable: {verdict}")
    say("  largest buffers: " + "; ".join(
        f"{b['bytes'] / GIB:.2f} GiB {b['dtype']}{b['shape']} ({b['part']})"
        for b in best["largest_buffers"][:5]))
    rep = best["replicated_leaves"]
    say(f"  replicated state: {best['replicated_state_bytes_per_device'] / GIB:.2f} GiB per "
        f"device in {len(rep)} leaves not split over every mesh axis" + (": " + ", ".join(
            f"{p} {b / GIB:.2f} GiB" for p, b in rep[:4]) if rep else ""))
    say("  communication per step (bytes one device sends):\n    " + summarize(
        CommBytes(best["collective_bytes_per_step"], [])).replace("\n", "\n    "))
    t = best["step_time_parts_s"]
    say(f"  step (roofline): compute {t['compute']:.2f} s + exposed communication "
        f"{t['exposed_communication']:.2f} s (inside hosts {t['ici']:.2f} s, across "
        f"{t['dcn']:.2f} s) + pipeline bubble {t['pipeline_bubble']:.2f} s = "
        f"{best['step_time_s']:.2f} s; {best['tokens_per_second']:,.0f} tokens/s, MFU "
        f"{100 * best['mfu']:.1f}%{fp8_text(best)}, {best['tokens_per_day'] / 1e9:.1f}B tokens/day")
    say(f"  compute priced at {100 * best['compute_efficiency']:.1f}% of that peak (remat "
        f"x{best['recompute_factor']:.2f}, load imbalance {best['load_imbalance']:g}): "
        f"{best['compute_efficiency_source']}")
    a2a = best["expert_all_to_all_bytes_per_device_per_step"]
    if a2a["routed"]:
        say(f"  expert all-to-all: {sum(a2a['routed'].values()) / 1e9:.1f} GB as balanced "
            f"routing sends it ({a2a['routed']['dcn'] / 1e9:.1f} across hosts), "
            f"{sum(a2a['compiled_capacity'].values()) / 1e9:.1f} GB of compiled buffers; "
            "priced at the routed bytes x the load imbalance")
    say("  " + overlap_line(best.get("overlap")))
    if best.get("flops_check"):
        say("  " + check_line(best["flops_check"]))
    if best["device_hours"] is not None:
        say(f"  cost: {best['tokens'] / 1e12:.3g}T tokens in {best['steps']:,} steps = "
            f"{best['device_hours']:,.0f} device-hours, {best['days']:.1f} days, "
            f"${best['cost_usd']:,.0f} at {best['price']}")
    say(f"  per trillion tokens: {best['device_hours_per_trillion_tokens']:,.0f} device-hours")
    say(f"  checkpoint: {best['checkpoint_bytes'] / 1e12:.2f} TB, saved in "
        f"{best['checkpoint_save_s'] / 60:.1f} min by {cluster.hosts} hosts at "
        f"{cluster.storage_write_bandwidth / 1e9:.1f} GB/s each")
    if not best["fits"]:
        say(f"  does not fit: {fix_hint(best, cluster)}")


def fits_nowhere(cfg, origins: dict[str, str], cluster: Cluster, valid: int) -> str:
    """The one line for a config no layout of which fits the cluster: the smallest cluster of
    that device kind (doubling the hosts) where one would, by the analytic estimate."""
    where = f"no layout fits {cluster.name}" if valid else (
        f"no mesh passes validation on {cluster.name}")
    hosts = cluster.hosts
    for _ in range(10):
        hosts *= 2
        bigger = dataclasses.replace(cluster, devices=hosts * cluster.devices_per_host,
                                     name=f"{hosts * cluster.devices_per_host}x{cluster.kind}")
        if search.ranked(cfg, origins, bigger).fitting:
            return (f"--cluster {cluster.name}: {where} by the analytic estimate ({valid} valid "
                    f"layouts); the smallest {cluster.kind} cluster where one does is about "
                    f"--cluster {bigger.name}, or lower data.global_batch_size")
    return (f"--cluster {cluster.name}: {where} ({valid} valid layouts), nor on "
            f"{hosts}x as many hosts; lower data.seq_len or data.global_batch_size")


def compiler_text(best: dict) -> str:
    """Which compiler produced the figures, with which kernels (the stand-ins on XLA:CPU)."""
    if best.get("compiler") == "gpu":
        calls = "; ".join(f"{part}: " + ", ".join(f"{n} {kind}" for kind, n in sorted(c.items()))
                          for part, c in sorted((best.get("kernel_calls") or {}).items()))
        return (f"compiled by XLA:GPU for deviceless {best['gpu_target'].upper()}s, with "
                "the config's kernels: "
                + ", ".join(f"{k}={v}" for k, v in best["kernels"].items())
                + f" (compiled to {calls or 'no kernel calls found'}); no autotuning, cuDNN "
                "workspaces not counted (docs/gpu_aot.md)")
    return ("compiled by XLA:CPU on fake devices, with the GPU's kernels where XLA:CPU has them, "
            "else: " + "; ".join(f"{k}={v} ({why})" for k, (v, why) in GPU_STAND_INS.items()))


def fix_hint(best: dict, cluster: Cluster) -> str:
    """What would make the layout fit: unshard replicated state, or a bigger cluster."""
    over = best["peak_bytes_per_device"] - best["usable_bytes_per_device"]
    if best["replicated_state_bytes_per_device"] > over:
        return (f"{best['replicated_state_bytes_per_device'] / GIB:.1f} GiB of state is "
                "replicated (above): no dim of those leaves divides by a mesh axis; pick mesh "
                "sizes their dims divide by")
    need = math.ceil(best["devices"] * best["peak_bytes_per_device"]
                     / best["usable_bytes_per_device"])
    hosts = math.ceil(need / cluster.devices_per_host)
    return (f"{over / GIB:.1f} GiB over; try --search, or about {hosts * cluster.devices_per_host}"
            f"x{cluster.kind} if memory fell in proportion")
