"""Bytes per device of the train step compiled by XLA:CPU (8 fake CPU devices) or by XLA:GPU
on a deviceless 8-GPU topology (maxmoe/plan/gpu_aot.py), plus collective and kernel counts and
the collective bytes the planner counts (maxmoe/plan/collectives.py: GB one device sends per
step, by kind, all axes together).

JAX_PLATFORMS=cpu python tools/gpu_aot_compare.py {cpu|gpu} [KEY=VALUE ...]
Needs jax[cuda12] (same version as jax) for `gpu`. Shape: configs/tiny.yaml +
configs/models/tiny_deepseek_v3.yaml on 2 data x 2 fsdp x 2 expert; prints one JSON line.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp

from maxmoe.bench import memory_analysis
from maxmoe.config_files import load_config
from maxmoe.plan.collectives import collective_bytes
from maxmoe.plan.gpu_aot import gpu_devices
from maxmoe.sharding import make_mesh, use_mesh
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate

SHAPE = ["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml"]
COUNTED = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-dot",
           "gemm_fusion", "__cublas", "__cudnn")


def main():
    target, overrides = sys.argv[1], sys.argv[2:]
    cfg, origins = load_config(SHAPE, ["mesh.cpu_devices=8", *overrides])
    if target == "gpu":
        devices = gpu_devices(8, "h200")
    else:
        jax.config.update("jax_num_cpu_devices", 8)
        devices = jax.devices("cpu")
    trainer = make_trainer(cfg, make_mesh(validate(cfg, 8, origins), devices))
    rows = (cfg.data.global_batch_size, cfg.data.seq_len)
    batch = {k: jax.ShapeDtypeStruct(rows, jnp.float32 if k == "loss_mask" else jnp.int32,
                                     sharding=trainer.batch_sharding)
             for k in ("tokens", "targets", "segment_ids", "positions", "loss_mask")}
    t = time.perf_counter()
    with use_mesh(trainer.mesh, trainer.rules):
        compiled = trainer.jitted_step.lower(trainer.abstract_state, batch).compile()
    hlo = compiled.as_text()
    comm = collective_bytes(hlo, trainer.mesh, devices_per_host=8)
    by_kind: dict[str, float] = {}
    for kinds in comm.by_axis.values():
        for kind, link in kinds.items():
            by_kind[kind] = by_kind.get(kind, 0.0) + (link["ici"] + link["dcn"]) / 1e9
    print(json.dumps({"target": target, "overrides": overrides,
                      "compile_s": round(time.perf_counter() - t, 1),
                      "memory": memory_analysis(compiled),
                      "hlo_counts": {k: hlo.count(k) for k in COUNTED},
                      "collective_gb": {k: round(v, 6) for k, v in sorted(by_kind.items())},
                      "collective_total_gb": round(sum(by_kind.values()), 6)}))


if __name__ == "__main__":
    main()
