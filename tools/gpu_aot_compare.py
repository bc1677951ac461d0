"""Bytes per device of the train step compiled by XLA:CPU (8 fake CPU devices) or by XLA:GPU
on a deviceless 8-GPU topology (maxmoe/plan/gpu_aot.py), plus what the MoE's grouped matmuls
and attention compiled to (plan/probe.kernel_calls), dense-expansion buffers, S x S score
buffers, collective and kernel counts and the collective bytes the planner counts
(maxmoe/plan/collectives.py: GB one device sends per step, by kind, all axes together).

JAX_PLATFORMS=cpu python tools/gpu_aot_compare.py {cpu|gpu} [--devices 8] [--hosts N] [--kind KIND]
    [CONFIG.yaml ...] [KEY=VALUE ...]
KIND: a configs/devices/ kind with a gpu_target (h100, h800, h200, b200; default h100).
Needs jax[cuda12] (same version as jax) and, for the GPU kernels, tokamax (`pip install -e
".[cuda]"`, Python >= 3.12) for `gpu`. Shape: the config files given, else configs/tiny.yaml +
configs/models/tiny_deepseek_v3.yaml (2 data x 2 fsdp x 2 expert unless overridden), with
the config's own kernels (`--compiler gpu`'s rule: auto picks tokamax on NVIDIA GPUs for
bfloat16); `cpu` compiles the planner's stand-ins. Prints one JSON line.
"""

import argparse
import json
import time

from maxmoe.bench import memory_analysis
from maxmoe.plan.collectives import collective_bytes
from maxmoe.plan.gpu_aot import dense_expansions, score_matrices, unknown_trip_loops
from maxmoe.plan.probe import compile_step, kernel_calls, largest_buffers

SHAPE = ["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml"]
COUNTED = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
           "gemm_fusion", "__cublas", "__cudnn", "mosaic_gpu")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("target", choices=["cpu", "gpu"])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--hosts", type=int, default=1)
    parser.add_argument("--kind", default="h100")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    t = time.perf_counter()
    files = [a for a in args.overrides if "=" not in a] or SHAPE
    overrides = [a for a in args.overrides if "=" in a]
    setup, compiled, _ = compile_step([*files, *overrides], args.devices, args.hosts,
                                      args.target, args.kind)
    cfg, sizes, hlo = setup.cfg, setup.mesh_sizes, compiled.as_text()
    comm = collective_bytes(hlo, setup.trainer.mesh, devices_per_host=args.devices // args.hosts)
    by_kind: dict[str, float] = {}
    for kinds in comm.by_axis.values():
        for kind, link in kinds.items():
            by_kind[kind] = by_kind.get(kind, 0.0) + (link["ici"] + link["dcn"]) / 1e9
    print(json.dumps({
        "target": args.target, "overrides": args.overrides,
        "compile_s": round(time.perf_counter() - t, 1),
        "memory": memory_analysis(compiled),
        "kernel_calls": kernel_calls(hlo),
        "dense_expansions": dense_expansions(hlo, cfg.moe.num_experts // sizes["expert"],
                                             cfg.model.hidden_size * cfg.moe.expert_mlp_size),
        "score_matrices": score_matrices(hlo, cfg.data.seq_len),
        "unknown_trip_loops": unknown_trip_loops(hlo),
        "largest_buffers": largest_buffers(hlo, 4),
        "hlo_counts": {k: hlo.count(k) for k in COUNTED},
        "collective_gb": {k: round(v, 6) for k, v in sorted(by_kind.items())},
        "collective_total_gb": round(sum(by_kind.values()), 6)}))


if __name__ == "__main__":
    main()
