"""The all-to-all rounds loop of one MoE layer under the deviceless XLA:GPU compile: its trip
counts, the whiles without one, memory, and the bytes each rounds loop's body writes per trip
(result sizes of its top-level fusions, custom calls, copies and collectives; collectives'
results are whole buffers, so this overcounts what they move). docs/performance/gpu.md, "Static
dispatch rounds", has the figures.

    JAX_PLATFORMS=cpu PYTHONPATH=. .venv312/bin/python tools/rounds_cost.py \\
        --ep 64 --tokens 4096 --dim 7168 --ffn 2048 --experts 256 --topk 8

jit(grad) of routed_experts (moe.transport=all_to_all, moe.grouped_matmul=tokamax, bf16) on
`ep` deviceless H100s, tokens data-parallel over the expert axis. Needs the CUDA plugin and
tokamax (Python >= 3.12).
"""

from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp

from maxmoe.bench import memory_analysis
from maxmoe.config import DEFAULT_RULES, MoEConfig
from maxmoe.kernels.tokamax_ops import kernel_device
from maxmoe.parallel.all_to_all import ROUNDS_SCOPE
from maxmoe.parallel.experts import routed_experts
from maxmoe.plan.gpu_aot import gpu_devices, unknown_trip_loops
from maxmoe.plan.hlo import attr, parse_module, shape_bytes
from maxmoe.sharding import make_mesh, named, use_mesh

_PLUMBING = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "while"}


def compiled_layer(a) -> str:
    """Optimised HLO text of the layer's jit(grad); prints its memory."""
    cfg = MoEConfig(num_experts=a.experts, experts_per_token=a.topk, expert_mlp_size=a.ffn,
                    transport="all_to_all", grouped_matmul="tokamax")
    mesh = make_mesh(dict(data=1, fsdp=1, pipeline=1, expert=a.ep, tensor=1),
                     devices=gpu_devices(a.ep, "h100"))
    tok = ("batch", "seq", None)
    with use_mesh(mesh, DEFAULT_RULES):
        def arg(shape, dtype, axes):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=named(axes))
        x = arg((a.ep, a.tokens, a.dim), jnp.bfloat16, tok)
        idx = arg((a.ep, a.tokens, a.topk), jnp.int32, tok)
        w = arg((a.ep, a.tokens, a.topk), jnp.bfloat16, tok)
        w_in = arg((a.experts, a.dim, a.ffn), jnp.bfloat16, ("experts", "embed", "expert_mlp"))
        w_out = arg((a.experts, a.ffn, a.dim), jnp.bfloat16, ("experts", "expert_mlp", "embed"))

        def loss(x, w, wg, wu, wd, idx):
            return jnp.sum(routed_experts(x, idx, w, wg, wu, wd, cfg)[0].astype(jnp.float32))
        with kernel_device(mesh.devices.flat):
            lowered = jax.jit(jax.grad(loss, argnums=range(5))).lower(x, w, w_in, w_in, w_out,
                                                                       idx)
        compiled = lowered.compile()
    mem = memory_analysis(compiled)
    print(f"temporaries {mem['temp_bytes'] / 2**20:.1f} MiB, peak {mem['peak_bytes'] / 2**20:.1f}"
          " MiB")
    return compiled.as_text()


def rounds_loops(hlo: str) -> None:
    """Prints each rounds loop's trip count and the bytes its body writes per trip."""
    comps, _ = parse_module(hlo)
    for ins in (i for instrs in comps.values() for i in instrs):
        if ins.opcode != "while" or f'/{ROUNDS_SCOPE}/while"' not in ins.attrs:
            continue
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
        kinds: dict[str, float] = {}
        for b in comps[attr(ins.attrs, "body").lstrip("%")]:
            if b.opcode not in _PLUMBING:
                kinds[b.opcode] = kinds.get(b.opcode, 0.0) + shape_bytes(b.type)
        top = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in
                        sorted(kinds.items(), key=lambda kv: -kv[1])[:5])
        print(f"{ins.name}: trips {trip.group(1) if trip else 'unknown'}, "
              f"{sum(kinds.values()) / 2**20:.1f} MiB written a trip ({top} MiB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("ep", 64), ("tokens", 4096), ("dim", 7168), ("ffn", 2048),
                          ("experts", 256), ("topk", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    hlo = compiled_layer(p.parse_args())
    print("whiles without a known trip count:", unknown_trip_loops(hlo) or "none")
    rounds_loops(hlo)


if __name__ == "__main__":
    main()
