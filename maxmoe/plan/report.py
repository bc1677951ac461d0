"""A plan's figures from one compiled layout on a cluster: the output contract of `maxmoe plan`
(its last line), the human table, and the config a run needs (`--write`)."""

from __future__ import annotations

from pathlib import Path

import yaml

from maxmoe.cluster import Cluster
from maxmoe.config import DEFAULT_RULES, MESH_AXES, Config
from maxmoe.plan.roofline import (
    DEFAULT_LOAD_IMBALANCE,
    LOAD_IMBALANCE_SOURCE,
    checkpoint,
    cost,
    link_bytes,
    price_compute,
    step_time,
    throughput,
)

GIB = 2.0**30


def priced_collectives(comm: dict, routed: dict | None, imbalance: float) -> dict:
    """`comm` (collective_bytes' {axis: {kind: {link: bytes}}}) with the expert axis's compiled
    all-to-all replaced by `routed` (prerank.routed_dispatch_bytes) x `imbalance`: what the step
    is priced with. `comm` itself where routed is None (other transports send what compiled)."""
    if routed is None:
        return comm
    out = {axis: dict(kinds) for axis, kinds in comm.items()}
    for axis, kinds in out.items():
        if "expert" in axis.split("+"):
            kinds.pop("all-to-all", None)
    out.setdefault("expert", {})["all-to-all"] = {k: v * imbalance for k, v in routed.items()}
    return out


def expert_all_to_all(comm: dict) -> dict[str, float]:
    """{"ici", "dcn"}: the compiled all-to-all bytes on the axes that include expert."""
    out = {"ici": 0.0, "dcn": 0.0}
    for axis, kinds in comm.items():
        if "expert" in axis.split("+"):
            for link, n in kinds.get("all-to-all", {}).items():
                out[link] += n
    return out


def compute_price(measured: dict, cluster: Cluster, load_imbalance: float | None):
    """(price_compute's ComputePrice, the imbalance applied, its source, the recompute factor)
    of one probe result; the imbalance is 1 where the expert axis is 1 (one shard)."""
    flops = measured["model_flops_per_step"]
    by_kernel = measured.get("model_flops_by_kernel_per_step") or {"gemm_bf16": flops}
    imbalance = DEFAULT_LOAD_IMBALANCE if load_imbalance is None else load_imbalance
    source = LOAD_IMBALANCE_SOURCE if load_imbalance is None else "--load-imbalance"
    if measured["mesh"].get("expert", 1) == 1:
        imbalance, source = 1.0, "1: one expert shard (mesh.expert 1)"
    recompute = measured["recompute_factor"]  # metrics.flops.recompute_factor, set by the probe
    price = price_compute(by_kernel, measured["devices"], cluster, imbalance=imbalance,
                          recompute=recompute)
    return price, imbalance, source, recompute


def plan_figures(measured: dict, cluster: Cluster, *, tokens: float | None = None,
                 steps: int | None = None, load_imbalance: float | None = None) -> dict:
    """The contract's JSON keys (and a few more) for one probe result (probe.measure's).
    Compute is priced per kernel class (roofline.price_compute) and the expert all-to-all at
    its balanced routed bytes x the load imbalance (default roofline.DEFAULT_LOAD_IMBALANCE)."""
    memory, devices = measured["memory"], measured["devices"]
    comm = measured["collectives"]
    flops = measured["model_flops_per_step"]
    price, imbalance, imbalance_source, recompute = compute_price(measured, cluster,
                                                                  load_imbalance)
    peak = price.peak
    routed = measured.get("routed_dispatch_bytes")
    priced = priced_collectives(comm, routed, imbalance)
    overlap = measured.get("overlap")  # read from XLA:GPU's schedule (overlap.py), if compiled so
    step = step_time(flops, devices, cluster, priced, measured["bubble"],
                     efficiency=price.efficiency, peak=peak,
                     exposed_comm_s=overlap["exposed_communication_s"] if overlap else None,
                     pipelined=measured["pipelined_share"])
    speed = throughput(step, measured["tokens_per_step"], flops, devices, peak)
    bill = cost(step.step_s, measured["tokens_per_step"], devices, cluster, tokens=tokens,
                steps=None if tokens else steps)
    ckpt_bytes, ckpt_s = checkpoint(measured["state_global_bytes"], cluster)
    return {
        "cluster": cluster.name, "mesh": measured["mesh"], "devices": devices,
        "layout": measured.get("layout", []), "weights": measured.get("weights", "zero3"),
        "peak_bytes_per_device": memory["peak_bytes"],
        "argument_bytes_per_device": memory["argument_bytes"],
        "device_memory_bytes": cluster.memory_bytes,
        "usable_bytes_per_device": cluster.usable_bytes,
        "fits": memory["peak_bytes"] <= cluster.usable_bytes,
        "memory_by_part": {"parameters": measured["state"]["params"],
                           "gradients": measured["grads_bytes"],
                           "optimizer_state": measured["state"]["opt_state"],
                           "batch": measured["batch_bytes"],
                           "temporaries": memory["temp_bytes"],
                           "activations_and_other_temporaries":
                               max(memory["temp_bytes"] - measured["grads_bytes"], 0)},
        "replicated_state_bytes_per_device": measured["replicated_state_bytes"],
        "replicated_leaves": measured["replicated"],
        "largest_buffers": measured["largest_buffers"],
        "collective_bytes_per_step": comm,
        "step_time_s": step.step_s,
        "step_time_parts_s": {"compute": step.compute_s, "ici": step.ici_s, "dcn": step.dcn_s,
                              "exposed_communication": step.exposed_comm_s,
                              "pipeline_bubble": step.bubble_s},
        # the same parts under their own keys (issue 41), and what the step moves and prices
        "compute_s": step.compute_s, "exposed_communication_s": step.exposed_comm_s,
        "bubble_s": step.bubble_s, "tokens_per_step": measured["tokens_per_step"],
        # the expert all-to-all as balanced routing sends it, not the compiled buffers
        "cross_host_bytes_per_device_per_step": link_bytes(priced_collectives(
            comm, routed, 1.0))["dcn"],
        "cross_host_bytes_per_device_per_step_compiled": link_bytes(comm)["dcn"],
        "expert_all_to_all_bytes_per_device_per_step": {
            "compiled_capacity": expert_all_to_all(comm), "routed": routed,
            "priced": expert_all_to_all(priced)},
        "load_imbalance": imbalance, "load_imbalance_source": imbalance_source,
        "compute_efficiency": price.efficiency, "compute_efficiency_source": price.source,
        "recompute_factor": recompute,
        # "schedule": exposed_communication_s read from XLA:GPU's compiled schedule ("overlap"
        # says how); "assumed": roofline.COMM_OVERLAP
        "overlap_source": "schedule" if overlap else "assumed", "overlap": overlap,
        "tokens_per_second": speed.tokens_per_s, "mfu": speed.mfu,
        "model_flops_fp8_per_step": measured.get("model_flops_fp8_per_step", 0.0),
        "mfu_peak_flops_per_device": peak,  # bf16, or the FP8 step's effective peak
        "tokens_per_day": speed.tokens_per_day,
        "device_hours_per_trillion_tokens": bill.device_hours_per_trillion_tokens,
        "cost_usd": bill.dollars, "device_hours": bill.device_hours, "days": bill.days,
        "steps": bill.steps, "tokens": bill.tokens,
        "price": f"${cluster.price_per_device_hour}/device-hour ({cluster.price_source}, "
                 f"{cluster.price_date})",
        "checkpoint_bytes": ckpt_bytes, "checkpoint_save_s": ckpt_s,
        "compile_s": measured.get("compile_s"), "wall_s": measured.get("wall_s"),
        "compiler": measured.get("compiler", "cpu"), "stand_ins": measured.get("stand_ins", {}),
        "gpu_target": measured.get("gpu_target"),
        "kernels": measured.get("kernels", {}),
        "cudnn_attention_calls": measured.get("cudnn_attention_calls", 0),
        "kernel_calls": measured.get("kernel_calls", {}),
        "flops_check": measured.get("flops_check"),  # compiled vs model FLOPs, per device
    }


def mesh_text(mesh: dict) -> str:
    """ "expert 64 (8 hosts) x fsdp 32 (32 hosts)": the axes over 1, with their DCN factor."""
    parts = []
    for axis in MESH_AXES:
        if mesh.get(axis, 1) > 1:
            dcn = mesh.get(f"dcn_{axis}", 1)
            parts.append(f"{axis} {mesh[axis]}" + (f" ({dcn} hosts)" if dcn > 1 else ""))
    return " x ".join(parts) or "1 device"


def table(rows: list[dict]) -> str:
    """One line per planned layout, best first: memory, step time, MFU and cost per 1T tokens."""
    head = (f"{'#':>2} {'mesh':<44} {'remat':<10} {'acc':>3} {'state':>7} {'temp':>7} "
            f"{'peak':>7} {'fits':>4} {'step s':>7} {'MFU':>6} {'Mtok/s':>7} "
            f"{'GPU-h/1T':>9} {'ici GB':>7} {'dcn GB':>7}")
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        arg = r["memory_by_part"]
        state = arg["parameters"] + arg["optimizer_state"]
        ici = sum(v["ici"] for k in r["collective_bytes_per_step"].values() for v in k.values())
        dcn = sum(v["dcn"] for k in r["collective_bytes_per_step"].values() for v in k.values())
        lines.append(
            f"{i:>2} {mesh_text(r['mesh']):<44} {r.get('remat', ''):<10} "
            f"{r.get('microbatches', 1):>3} {state / GIB:>6.1f}G {arg['temporaries'] / GIB:>6.1f}G "
            f"{r['peak_bytes_per_device'] / GIB:>6.1f}G {'yes' if r['fits'] else 'NO':>4} "
            f"{r['step_time_s']:>7.2f} {100 * r['mfu']:>5.1f}% "
            f"{r['tokens_per_second'] / 1e6:>7.3f} "
            f"{r['device_hours_per_trillion_tokens'] / 1e3:>8.1f}K {ici / 1e9:>7.1f} "
            f"{dcn / 1e9:>7.1f}")
    return "\n".join(lines)


def run_config(cfg: Config, figures: dict) -> dict:
    """The keys a run of this layout needs: mesh sizes and DCN factors, non-default rules,
    batch, remat, accumulation and pipeline schedule."""
    mesh = {a: figures["mesh"][a] for a in MESH_AXES}
    mesh.update({f"dcn_{a}": figures["mesh"][f"dcn_{a}"] for a in MESH_AXES})
    rules = {k: v for k, v in cfg.mesh.rules.items() if DEFAULT_RULES.get(k) != v}
    if rules:
        mesh["rules"] = rules
    return {
        "mesh": mesh,
        "data": {"seq_len": cfg.data.seq_len, "global_batch_size": cfg.data.global_batch_size},
        "model": {"remat_policy": cfg.model.remat_policy,
                  "pipeline_schedule": cfg.model.pipeline_schedule,
                  "pipeline_microbatches": cfg.model.pipeline_microbatches,
                  "pipeline_repeats": cfg.model.pipeline_repeats},
        "train": {"grad_accum_steps": cfg.train.grad_accum_steps},
    }


def write_config(path: str, cfg: Config, figures: dict, cluster: Cluster) -> None:
    """Writes run_config as YAML with a header naming the cluster and the plan's peak."""
    head = (f"# maxmoe plan: best layout on {cluster.name} ({cluster.devices} x {cluster.kind});"
            f" peak {figures['peak_bytes_per_device'] / GIB:.1f} GiB of "
            f"{cluster.usable_bytes / GIB:.1f} GiB usable per device, step "
            f"{figures['step_time_s']:.2f} s (roofline). Use it after the model config.\n")
    Path(path).write_text(head + yaml.safe_dump(run_config(cfg, figures), sort_keys=False))
