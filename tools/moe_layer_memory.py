"""Memory per device of one MoE layer's routed experts, forward + backward, per dispatch path,
from the compiled HLO (`compiled.memory_analysis()`: arguments + temporaries) on fake CPU
devices. Nothing is allocated: the arguments are abstract.

    python3 tools/moe_layer_memory.py                      # V3 shapes, ep 8 and 64, table
    python3 tools/moe_layer_memory.py --ep 8 --tokens 256 --dim 64 --ffn 32  # small

Shapes (defaults: DeepSeek-V3): --tokens per device, --dim D, --experts E, --topk K, --ffn F,
bfloat16. The mesh is `expert=ep` alone (tokens data-parallel over it, as the default rules
shard the batch over `expert`). Paths: all_gather, all_to_all and two_level (dropless,
moe.transport; two_level with V3's 8 groups, 4 a token, over ep / --per-host hosts) and
capacity (moe.capacity_factor 1.25); the CPU grouped matmul is `blocked`, the planner's GPU
stand-in. `--compiler gpu` compiles for H100s instead, deviceless: the exchange is then
ragged_all_to_all, as on a GPU (the grouped matmul stays `blocked`: a deviceless XLA:GPU
compile expands ragged_dot into dense per-expert matmuls, hundreds of GiB at these shapes). Each (ep, path) compiles in its own subprocess, whose device count must be set
before JAX starts (--xla_force_host_platform_device_count).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout: the child imports maxmoe from it
PATHS = {"all_gather": ["moe.transport=all_gather"],
         "all_to_all": ["moe.transport=all_to_all"],
         # DeepSeek-V3's group-limited routing (n_group 8, topk_group 4), hosts of --per-host
         "two_level": ["moe.transport=two_level", "moe.num_groups=8", "moe.groups_per_token=4"],
         "capacity": ["moe.dispatch=capacity", "moe.capacity_factor=1.25"]}


def measure(ep: int, path: str, a) -> dict:
    """Compiles jit(grad) of routed_experts on `ep` fake devices; bytes per device."""
    # late: JAX must start after XLA_FLAGS is set (this runs in the child process)
    import jax
    import jax.numpy as jnp

    from maxmoe.config import DEFAULT_RULES
    from maxmoe.config_files import load_config
    from maxmoe.parallel.experts import routed_experts
    from maxmoe.plan.gpu_aot import gpu_devices
    from maxmoe.plan.probe import largest_buffers
    from maxmoe.sharding import make_mesh, named, use_mesh

    hosts = [f"moe.expert_hosts={max(1, ep // a.per_host)}"] if path == "two_level" else []
    cfg, _ = load_config([], [f"moe.num_experts={a.experts}", f"moe.experts_per_token={a.topk}",
                              f"moe.expert_mlp_size={a.ffn}", "moe.grouped_matmul=blocked",
                              *PATHS[path], *hosts])
    moe = cfg.moe
    sizes = dict(data=1, fsdp=1, pipeline=1, expert=ep, tensor=1)
    if a.compiler == "gpu":  # deviceless XLA:GPU (docs/gpu_aot.md): ragged_all_to_all
        mesh = make_mesh(sizes, devices=gpu_devices(ep, "h100"))
    else:
        mesh = make_mesh(sizes)
    dt = jnp.bfloat16
    with use_mesh(mesh, DEFAULT_RULES):
        tok = named(("batch", "seq", None))
        w_in, w_out = named(("experts", "embed", "expert_mlp")), named(
            ("experts", "expert_mlp", "embed"))
        spec = jax.ShapeDtypeStruct
        args = (spec((ep, a.tokens, a.dim), dt, sharding=tok),
                spec((ep, a.tokens, a.topk), jnp.int32, sharding=tok),
                spec((ep, a.tokens, a.topk), jnp.float32, sharding=tok),
                spec((a.experts, a.dim, a.ffn), dt, sharding=w_in),
                spec((a.experts, a.dim, a.ffn), dt, sharding=w_in),
                spec((a.experts, a.ffn, a.dim), dt, sharding=w_out))

        def loss(x, idx, w, wg, wu, wd):
            y, _ = routed_experts(x, idx, w, wg, wu, wd, moe)
            return jnp.sum(y.astype(jnp.float32))
        grad = jax.jit(jax.grad(loss, argnums=(0, 2, 3, 4, 5)))
        compiled = grad.lower(*args).compile()
        m = compiled.memory_analysis()
        if os.environ.get("MOE_MEMORY_BUFFERS"):  # debugging: the largest arrays, to stderr
            for row in largest_buffers(compiled.as_text(), 12):
                print(row, file=sys.stderr)
    return {"ep": ep, "path": path, "argument_bytes": m.argument_size_in_bytes,
            "temp_bytes": m.temp_size_in_bytes, "output_bytes": m.output_size_in_bytes}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=[8, 64])
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--per-host", type=int, default=8,
                   help="two_level: devices a host (the expert axis spans ep / this hosts)")
    p.add_argument("--compiler", choices=["cpu", "gpu"], default="cpu",
                   help="gpu: deviceless XLA:GPU compile for H100s (needs jax[cuda12], run "
                   "with /work/venv-gpuaot/bin/python; docs/gpu_aot.md)")
    p.add_argument("--child", nargs=2, metavar=("EP", "PATH"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(measure(int(a.child[0]), a.child[1], a)))
        return 0
    gib = 2.0 ** 30
    print("| ep | path | arguments GiB | temporaries GiB | args + temps GiB |\n"
          "|---:|---|---:|---:|---:|")
    shape = ["--tokens", str(a.tokens), "--dim", str(a.dim), "--experts", str(a.experts),
             "--topk", str(a.topk), "--ffn", str(a.ffn), "--per-host", str(a.per_host),
             "--compiler", a.compiler]
    for ep in a.ep:
        for path in a.paths:
            path_env = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
            env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path_env,
                       XLA_FLAGS=f"--xla_force_host_platform_device_count={ep}")
            out = subprocess.run([sys.executable, __file__, *shape, "--child", str(ep), path],
                                 env=env, capture_output=True, text=True, check=False)
            if out.returncode:
                print(f"| {ep} | {path} | failed: {out.stderr.strip().splitlines()[-1]} |||")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            args, temps = r["argument_bytes"] / gib, r["temp_bytes"] / gib
            print(f"| {ep} | {path} | {args:.2f} | {temps:.2f} | {args + temps:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
