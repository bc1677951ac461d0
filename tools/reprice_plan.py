"""Re-prices a saved `maxmoe plan` JSON with today's roofline (kernel-level compute, routed
expert all-to-all, load imbalance) without compiling again: the compiled collective bytes and
the mesh come from the file, the FLOP split and the routed bytes from the config.

    python3 tools/reprice_plan.py PLAN_OUTPUT CONFIG... [KEY=VALUE...] [--cluster 2048xh800]
        [--tokens 1T] [--load-imbalance 1.1]

PLAN_OUTPUT is a file whose last JSON object is a plan's (`maxmoe plan ... > out.txt`); the
config items must be the ones that plan compiled. Prints the old and new figures as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from maxmoe.cluster import load_cluster
from maxmoe.config_files import load_config
from maxmoe.metrics.flops import flops_by_kernel, flops_per_token
from maxmoe.plan.prerank import routed_dispatch_bytes
from maxmoe.plan.report import compute_price, expert_all_to_all, priced_collectives
from maxmoe.plan.roofline import cost, link_bytes, parse_tokens, step_time


def last_plan(path: str) -> dict:
    """The last JSON object (a line starting with '{') of a plan's output."""
    lines = [x for x in Path(path).read_text().splitlines() if x.startswith("{")]
    return json.loads(lines[-1])


def reprice(old: dict, items: list[str], cluster_spec: str, tokens: float,
            imbalance: float | None) -> dict:
    """The new figures of the plan `old` (its mesh, collectives, remat, bubble kept)."""
    cfg, _ = load_config([a for a in items if "=" not in a], [a for a in items if "=" in a])
    cluster = load_cluster(cluster_spec)
    mesh, devices = old["mesh"], old["devices"]
    sizes = {a: mesh[a] for a in ("data", "fsdp", "pipeline", "expert", "tensor")}
    routed = routed_dispatch_bytes(cfg, sizes, {a: mesh[f"dcn_{a}"] for a in sizes})
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    flops = flops_per_token(cfg) * tokens_per_step
    measured = {"model_flops_per_step": flops, "mesh": mesh, "devices": devices,
                "remat": cfg.model.remat_policy,
                "model_flops_by_kernel_per_step": {
                    k: f * tokens_per_step for k, f in flops_by_kernel(cfg).items()}}
    price, imb, _, recompute = compute_price(measured, cluster, imbalance)
    comm = old["collective_bytes_per_step"]
    priced = priced_collectives(comm, routed, imb)
    bubble = old["step_time_parts_s"]["pipeline_bubble"] / max(
        old["step_time_parts_s"]["compute"], 1e-30)
    step = step_time(flops, devices, cluster, priced, bubble / (1 + bubble),
                     efficiency=price.efficiency, peak=price.peak)
    bill = cost(step.step_s, tokens_per_step, devices, cluster, tokens=tokens)
    return {"compute_s": step.compute_s, "exposed_communication_s": step.exposed_comm_s,
            "bubble_s": step.bubble_s, "step_time_s": step.step_s,
            "tokens_per_second_per_device": tokens_per_step / step.step_s / devices,
            "device_hours_per_trillion_tokens": bill.device_hours_per_trillion_tokens,
            "compute_efficiency": price.efficiency, "recompute_factor": recompute,
            "load_imbalance": imb,
            "expert_all_to_all": {"compiled_capacity": expert_all_to_all(comm),
                                  "routed": routed, "priced": expert_all_to_all(priced)},
            "cross_host_bytes_routed": link_bytes(priced_collectives(comm, routed, 1.0))["dcn"],
            "cross_host_bytes_compiled": link_bytes(comm)["dcn"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("plan_output")
    p.add_argument("items", nargs="+")
    p.add_argument("--cluster", default="")
    p.add_argument("--tokens", default="1T")
    p.add_argument("--load-imbalance", type=float, default=None)
    args = p.parse_args()
    old = last_plan(args.plan_output)
    parts = old["step_time_parts_s"]
    before = {"compute_s": parts["compute"], "exposed_communication_s":
              parts["exposed_communication"], "bubble_s": parts["pipeline_bubble"],
              "step_time_s": old["step_time_s"],
              "tokens_per_second_per_device": old["tokens_per_second"] / old["devices"],
              "device_hours_per_trillion_tokens": old["device_hours_per_trillion_tokens"]}
    after = reprice(old, args.items, args.cluster or old["cluster"],
                    parse_tokens(args.tokens), args.load_imbalance)
    print(json.dumps({"before": before, "after": after}, indent=1))


if __name__ == "__main__":
    main()
