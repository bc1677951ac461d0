"""Compile time of the train step against depth (it must stay flat: layers are scanned).

python tools/bench_compile.py [--layers 4 16 61] [KEY=VALUE ...]
Uses configs/models/tiny_deepseek_v3.yaml (MLA, sigmoid group routing, a first dense layer,
MTP depth 1) at CPU width on one CPU device; prints one line per depth and a JSON line.
"""

import argparse
import json
import time

import jax

from maxmoe.bench import synthetic_batch
from maxmoe.config_files import load_config
from maxmoe.sharding import global_batch, make_mesh, use_mesh
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate

SHAPE = ["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml"]


def compile_time(layers: int, overrides: list[str]) -> float:
    cfg, origins = load_config(SHAPE, [f"model.num_layers={layers}", "mesh.cpu_devices=1",
                                       "mesh.data=1", "mesh.fsdp=1", "mesh.expert=1",
                                       "mesh.tensor=1", *overrides])
    trainer = make_trainer(cfg, make_mesh(validate(cfg, 1, origins), jax.devices()[:1]))
    state = trainer.abstract_state
    batch = global_batch(synthetic_batch(cfg), trainer.batch_sharding)
    t = time.perf_counter()
    with use_mesh(trainer.mesh, trainer.rules):
        trainer.jitted_step.lower(state, batch).compile()
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, nargs="+", default=[4, 16, 61])
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    jax.config.update("jax_num_cpu_devices", 1)
    times = {n: compile_time(n, a.overrides) for n in a.layers}
    for n, t in times.items():
        print(f"{n:3d} layers: compile {t:.1f} s ({t / times[a.layers[0]]:.2f}x the {a.layers[0]}-layer)")
    print(json.dumps({"compile_s": times}))


if __name__ == "__main__":
    main()
