"""Whether FP8 GEMMs run as FP8: counts of FP8 matmuls in XLA's optimized HLO (issue 28 item 4).

python tools/fp8_hlo.py kernels [--aot h200]
    fp8_dot (tensorwise, blockwise) and fp8_ragged_dot, forward + both gradients, each compiled
    alone at one shape, beside the plain bf16 dot / ragged_dot.
python tools/fp8_hlo.py step CONFIG.yaml ... [KEY=VALUE ...] [--fp8 none,tensorwise,blockwise]
        [--aot h200 --devices N]
    one train step of the config per FP8 mode.
Compiles on this machine's devices (a GPU on the lent machine), or with --aot KIND for a
deviceless XLA:GPU target (maxmoe/plan/gpu_aot.py: JAX_PLATFORMS=cpu and the jax CUDA plugin,
e.g. /work/venv-gpuaot). Prints one JSON line per compiled function: its name, compile seconds
and `fp8_counts` of its optimized HLO. The evidence: cuBLASLt FP8 custom calls
(`__cublas$lt$matmul$f8`) or dots / ragged dots whose operands are f8e4m3fn / f8e5m2 (a Triton
GEMM fusion's dot); an FP8 mode with none of them upcast its GEMMs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from maxmoe.config_files import load_config
from maxmoe.kernels.fp8 import fp8_dot
from maxmoe.kernels.fp8_ragged import fp8_ragged_dot
from maxmoe.kernels.tokamax_ops import kernel_device
from maxmoe.plan.gpu_aot import gpu_devices
from maxmoe.sharding import make_mesh, use_mesh
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate

F8 = re.compile(r"^f8e(?:4m3fn|5m2)\[")
CUSTOM = re.compile(r'custom_call_target="([^"]+)"')
OP_NAME = re.compile(r'op_name="([^"]*)"')
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.-]+)\s*=\s*(.+?)\s+([\w-]+)\((.*)")
OPERAND = re.compile(r"%[\w.-]+")


def fp8_counts(hlo: str, scope: str = "") -> dict[str, int]:
    """Counts over an HLO module's text (scope: only instructions whose op_name metadata
    contains it, e.g. "attention/projection"): dots and ragged dots, those with an FP8 operand (an
    operand whose instruction in the same computation is typed f8e4m3fn / f8e5m2: the printed
    dot names its operands without types), cuBLAS(Lt) custom calls by target
    (`__cublas$lt$matmul$f8` is the FP8 GEMM) and the instructions producing FP8 values (the
    quantising converts and what carries them)."""
    out = dict.fromkeys(("dots", "f8_dots", "ragged_dots", "f8_ragged_dots", "f8_values"), 0)
    types: dict[str, str] = {}
    for line in hlo.splitlines():
        if line.rstrip().endswith("{") and "=" not in line.split("(", 1)[0]:
            types = {}  # a new computation: names are its own
            continue
        match = INSTRUCTION.match(line)
        if match is None:
            continue
        name, shape, op, rest = match.groups()
        types[name] = shape
        op_name = OP_NAME.search(line)
        if scope and (op_name is None or scope not in op_name.group(1)):
            continue
        out["f8_values"] += bool(F8.match(shape))
        if op in ("dot", "ragged-dot"):
            key = "dots" if op == "dot" else "ragged_dots"
            operands = OPERAND.findall(rest.split(")", 1)[0])
            out[key] += 1
            out[f"f8_{key}"] += any(F8.match(types.get(o, "")) for o in operands)
        target = CUSTOM.search(rest)
        if op == "custom-call" and target and "cublas" in target.group(1):
            key = f"custom_call {target.group(1)}"
            out[key] = out.get(key, 0) + 1
    return out


def report(name: str, lowered, **extra) -> dict:
    """Compiles `lowered`, prints and returns {name, compile_s, fp8_counts, **extra}."""
    t = time.perf_counter()
    compiled = lowered.compile()
    row = {"name": name, "compile_s": round(time.perf_counter() - t, 1),
           "fp8_counts": fp8_counts(compiled.as_text()), **extra}
    print(json.dumps(row), flush=True)
    return row


def kernels(device, m: int = 4096, k: int = 1024, n: int = 512, groups: int = 16) -> list[dict]:
    """fp8_dot per mode and fp8_ragged_dot per mode, forward + gradients of x and w, and the
    bf16 dot / ragged_dot they replace; x [m, k], w [k, n] (ragged: [groups, k, n])."""
    place = SingleDeviceSharding(device)
    spec = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=place)  # noqa: E731
    x, w, wg = spec((m, k)), spec((k, n)), spec((groups, k, n))
    sizes = spec((groups,), jnp.int32)

    g = spec((m, n))

    def grads(f):
        """(a, b, g, *sizes) -> (f's output, a's and b's gradients for the output cotangent g):
        g an input, so that XLA cannot constant-fold its quantisation away."""
        def fwd_bwd(a, b, g, *s):
            y, pull = jax.vjp(lambda a, b: f(a, b, *s), a, b)
            return y, *pull(g)
        return jax.jit(fwd_bwd)

    rows = [report("dot bf16", grads(lambda a, b: a @ b).lower(x, w, g), shape=[m, k, n])]
    rows.append(report("ragged_dot bf16", grads(
        lambda a, b, s: jax.lax.ragged_dot(a, b, s)).lower(x, wg, g, sizes), groups=groups))
    for mode in ("tensorwise", "blockwise"):
        rows.append(report(f"fp8_dot {mode}",
                           grads(lambda a, b, mode=mode: fp8_dot(a, b, mode)).lower(x, w, g)))
        rows.append(report(f"fp8_ragged_dot {mode}", grads(
            lambda a, b, s, mode=mode: fp8_ragged_dot(a, b, s, mode)).lower(x, wg, g, sizes)))
    return rows


def step(files: list[str], overrides: list[str], modes: list[str], devices) -> list[dict]:
    """One train step of the config per precision.fp8 mode, compiled on `devices`."""
    rows = []
    for mode in modes:
        cfg, origins = load_config(files, [*overrides, f"precision.fp8={mode}"])
        trainer = make_trainer(cfg, make_mesh(validate(cfg, len(devices), origins), devices))
        shape = (cfg.data.global_batch_size, cfg.data.seq_len)
        batch = {key: jax.ShapeDtypeStruct(shape, jnp.float32 if key == "loss_mask" else jnp.int32,
                                           sharding=trainer.batch_sharding)
                 for key in ("tokens", "targets", "segment_ids", "positions", "loss_mask")}
        with use_mesh(trainer.mesh, trainer.rules), kernel_device(trainer.mesh.devices.flat):
            lowered = trainer.jitted_step.lower(trainer.abstract_state, batch)
            rows.append(report(f"train step fp8={mode}", lowered, config=files,
                               overrides=overrides))
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("kernels", "step"))
    p.add_argument("items", nargs="*", help="step: config files, then KEY=VALUE overrides")
    p.add_argument("--fp8", default="tensorwise,blockwise", help="step: modes to compile")
    p.add_argument("--aot", default="", help="deviceless XLA:GPU target: a configs/devices/ kind with a gpu_target")
    p.add_argument("--devices", type=int, default=1, help="--aot: devices of the topology")
    args = p.parse_args(argv)
    devices = gpu_devices(args.devices, args.aot) if args.aot else jax.devices()
    print(json.dumps({"devices": [str(d) for d in devices[:2]], "jax": jax.__version__,
                      "aot": args.aot or None}), flush=True)
    if args.what == "kernels":
        kernels(devices[0])
        return 0
    files = [i for i in args.items if "=" not in i]
    step(files, [i for i in args.items if "=" in i], args.fp8.split(","), devices)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
