"""Compiles the real train step of one layout on fake CPU devices and measures what it needs.

`run_probe(items, devices, hosts)` starts `python -m maxmoe.plan.probe` in a subprocess (JAX
fixes the fake CPU device count once per process), which loads the config, validates it for
`devices` devices on `hosts` hosts, lowers the jitted train step with abstract arrays (no
memory is allocated), compiles it and prints one JSON object: XLA's memory analysis per
device, the state's bytes per device by part (read from the abstract shardings), the state
leaves not split over every mesh axis, the largest buffers of the compiled program, the collective
bytes per step (collectives.py), and the compiled matmul FLOPs beside the model's
(compiled_flops.py).

compiler "cpu" (the default) compiles with XLA:CPU on fake CPU devices: where a CPU compile
differs from the GPU's, the probe compiles the GPU's choice where XLA:CPU can, and otherwise the
closest form XLA:CPU compiles (GPU_STAND_INS says which and why). compiler "gpu" compiles with
XLA:GPU on deviceless GPUs of the cluster's kind (gpu_aot.py; needs jax's CUDA plugin) the
config's own kernels, `auto` resolved for those GPUs as a run there resolves it (tokamax's
Mosaic GPU kernels on NVIDIA GPUs), lowered inside kernel_device so that tokamax sees them; given
the cluster, it also reads the communication the compiled schedule leaves exposed (overlap.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import jax
import numpy as np

from maxmoe.bench import memory_analysis
from maxmoe.cluster import Cluster
from maxmoe.config import ConfigError
from maxmoe.config_files import load_config
from maxmoe.kernels.tokamax_ops import kernel_device
from maxmoe.metrics.flops import (
    flops_by_kernel,
    fp8_params_per_token,
    pipelined_share,
    recompute_factor,
)
from maxmoe.model.spec import pipeline_idle
from maxmoe.plan import gpu_aot
from maxmoe.plan.collectives import collective_bytes
from maxmoe.plan.compiled_flops import flops_check
from maxmoe.plan.hlo import dtype_bytes
from maxmoe.plan.overlap import cluster_rates, schedule_overlap
from maxmoe.plan.prerank import routed_dispatch_bytes
from maxmoe.plan.report import compute_price, expert_all_to_all, priced_collectives
from maxmoe.sharding import use_mesh
from maxmoe.train.setup import RunSetup, prepare_run
from maxmoe.validation import validate

# key -> (value compiled on CPU, why). NVIDIA GPUs run tokamax's Mosaic grouped GEMM and flash
# attention (`auto`); XLA:CPU has neither, lowers ragged_dot densely (a [rows, experts, F]
# product) and `fused` attention to a full [B, H, S, S] score matrix, so the probe compiles the
# blocked grouped matmul (rows x F live, as the grouped GEMM) and causal query-block attention.
GPU_STAND_INS = {
    "moe.grouped_matmul": ("blocked", "XLA:CPU lowers ragged_dot densely; blocked keeps the "
                                      "grouped GEMM's rows x F buffers"),
    "attention.implementation": ("einsum", "XLA:CPU has no flash attention; causal query "
                                           "blocks keep [B, H, block, S] scores, not S x S"),
}
COMPILERS = ("cpu", "gpu")
TOP_BUFFERS = 8
_SHAPE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')

@dataclass(frozen=True)
class ProbeFailed(Exception):
    """The subprocess died (out of host memory, a compiler crash): its last lines say why."""
    message: str

    def __str__(self) -> str:
        return self.message


def leaf_bytes(abstract) -> int:
    """Bytes one device holds of a ShapeDtypeStruct with a sharding."""
    shape = abstract.sharding.shard_shape(abstract.shape)
    return math.prod(shape) * abstract.dtype.itemsize


def state_parts(abstract_state) -> dict[str, int]:
    """Bytes per device of each top-level part of the train state (params, opt_state, ...)."""
    return {part: sum(leaf_bytes(a) for a in jax.tree.leaves(tree))
            for part, tree in abstract_state.items()}


def replicated_leaves(abstract_state, devices: int) -> list[tuple[str, int]]:
    """(path, bytes per device) of the params, optimizer state and buffers leaves that are not
    split over all `devices` (a mesh axis no dim of theirs divides: `sharding.state_dim_axes`),
    largest first (scalars left out: counters); empty on one device. The guard's and loss
    scale's few statistics are replicated by design and not listed."""
    if devices == 1:
        return []
    out = []
    model_state = {k: v for k, v in abstract_state.items()
                   if k in ("params", "opt_state", "buffers")}
    for path, a in jax.tree_util.tree_leaves_with_path(model_state):
        if a.shape and math.prod(a.shape) < devices * math.prod(a.sharding.shard_shape(a.shape)):
            out.append((jax.tree_util.keystr(path, simple=True, separator="/"), leaf_bytes(a)))
    return sorted(out, key=lambda x: -x[1])


def model_part(op_name: str) -> str:
    """"phase: path" of the model part an HLO instruction came from, from its JAX op_name
    (e.g. "backward: moe/shard_map" from jit(train_step)/transpose(jvp())/while/body/...)."""
    phase = ("backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name
             else "update" if "optimizer" in op_name else "step")
    skip = re.compile(r"^(train_step|while|body|cond|branch_\w*|closed_call|checkpoint|remat\w*|"
                      r"pjit|_\w+|dynamic_\w+)?$")
    names = [re.sub(r"^(?:(?:jit|jvp|transpose)\()+|\)+$", "", p) for p in op_name.split("/")]
    path = [n for n in names if not skip.match(n)]
    return f"{phase}: {'/'.join(path[-4:])}"


_NOT_BUFFERS = (" parameter(", " get-tuple-element(", " bitcast(", " tuple(", " constant(")


def largest_buffers(hlo_text: str, top: int = TOP_BUFFERS) -> list[dict]:
    """The `top` largest arrays the compiled HLO materialises per device (instruction results
    outside fusion bodies, which XLA keeps in registers and caches), each with shape, dtype and
    the model part its op_name names; one entry per distinct (shape, dtype, part)."""
    fused = set(re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", hlo_text))
    seen, rows, skipping = set(), [], False
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():  # a computation header (or its closing brace)
            name = line.removeprefix("ENTRY ").split(" ", 1)[0].lstrip("%")
            skipping = name in fused
            continue
        m = _SHAPE.match(line)
        if skipping or not m or m.group(2) in ("token", "opaque") or any(
                k in line for k in _NOT_BUFFERS):
            continue
        dims = [int(d) for d in m.group(3).split(",") if d]
        op = _OP_NAME.search(line)
        part = model_part(op.group(1)) if op else m.group(1)
        key = (tuple(dims), m.group(2), part)
        if key not in seen:
            seen.add(key)
            rows.append({"bytes": int(math.prod(dims) * dtype_bytes(m.group(2))), "shape": dims,
                         "dtype": m.group(2), "part": part})
    return sorted(rows, key=lambda r: -r["bytes"])[:top]


def abstract_batch(cfg, sharding) -> dict:
    """ShapeDtypeStructs of one global batch, as the loop feeds the step."""
    shape = (cfg.data.global_batch_size, cfg.data.seq_len)
    dtypes = {"tokens": np.int32, "targets": np.int32, "segment_ids": np.int32,
              "positions": np.int32, "loss_mask": np.float32}
    return {k: jax.ShapeDtypeStruct(shape, d, sharding=sharding) for k, d in dtypes.items()}


def stand_in_overrides(compiler: str = "cpu") -> list[str]:
    """The KEY=VALUE overrides applied after the user's own: GPU_STAND_INS for XLA:CPU, none
    for XLA:GPU (the config's own kernels)."""
    if compiler == "gpu":
        return []
    return [f"{key}={value}" for key, (value, _) in GPU_STAND_INS.items()]


_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def priced_flops(cfg, calls: dict[str, dict[str, int]]) -> dict[str, float]:
    """flops_by_kernel per token as the step compiled (`calls`: kernel_calls'): routed experts
    compiled to tokamax's Mosaic kernels run FP8's values in bf16 math
    (kernels/fp8_ragged.dequantised_ragged_dot), so they are priced as bf16."""
    mosaic = any(k.startswith("mosaic_gpu") for k in calls.get("moe grouped matmul", {}))
    return flops_by_kernel(cfg, routed_in_fp8=not mosaic)


def kernel_calls(hlo_text: str) -> dict[str, dict[str, int]]:
    """What the MoE's grouped matmuls and attention compiled to: for each part ("moe grouped
    matmul", "attention"), the compiled program's custom-call targets (tokamax's Mosaic GPU
    kernels: mosaic_gpu*; cuDNN: __cudnn$fmha*) and XLA dots ("dot") by count, read from the
    op_names (forward and backward together)."""
    out: dict[str, dict[str, int]] = {}
    for line in hlo_text.splitlines():
        op = _OP_NAME.search(line)
        if not op:
            continue
        name = op.group(1)
        part = ("moe grouped matmul" if "grouped_matmul" in name
                else "attention" if "attention" in name and "projection" not in name else "")
        call = _CUSTOM_CALL.search(line)
        kind = call.group(1) if call else "dot" if re.search(r"= \S+ dot\(", line) else ""
        if part and kind:
            counts = out.setdefault(part, {})
            counts[kind] = counts.get(kind, 0) + 1
    return out


def measure(items: list[str], devices: int, hosts: int, devices_per_host: int,
            compiler: str = "cpu", kind: str = "", cluster: Cluster | None = None,
            load_imbalance: float | None = None) -> dict:
    """Figures of one layout (module docstring); runs in the probe's own process, whose fake
    CPU device count it sets (compiler "cpu"), or on `devices` deviceless GPUs of the cluster's
    device `kind` (compiler "gpu"). With compiler "gpu" and the `cluster`, also "overlap"
    (overlap_figures). Raises ConfigError before compiling when the layout is invalid or the
    GPU target or plugin is missing."""
    t = time.perf_counter()
    setup, compiled, kernels = compile_step(items, devices, hosts, compiler, kind)
    hlo = compiled.as_text()  # once: hundreds of MB at thousands of devices
    result = compiled_figures(setup, compiled, devices_per_host, hlo)
    result.update(kernels, compile_s=round(time.perf_counter() - t, 1))
    if compiler == "gpu" and cluster is not None:
        result["overlap"] = overlap_figures(hlo, setup.trainer.mesh, devices_per_host,
                                            cluster, result, load_imbalance)
    return result


def overlap_figures(hlo_text: str, mesh, devices_per_host: int, cluster: Cluster,
                    measured: dict, load_imbalance: float | None) -> dict:
    """overlap.schedule_overlap's JSON for a compiled XLA:GPU step on the cluster, the expert
    all-to-all timed at the bytes the plan prices it at (report.priced_collectives: balanced
    routed bytes x the load imbalance, per link, over the compiled buffers')."""
    _, imbalance, _, _ = compute_price(measured, cluster, load_imbalance)
    comm = measured["collectives"]
    compiled = expert_all_to_all(comm)
    priced = expert_all_to_all(priced_collectives(comm, measured.get("routed_dispatch_bytes"),
                                                  imbalance))
    scale = {link: priced[link] / n for link, n in compiled.items() if n > 0}
    return schedule_overlap(hlo_text, mesh, devices_per_host, cluster_rates(cluster),
                            scale).to_json()


def compile_step(items: list[str], devices: int, hosts: int, compiler: str = "cpu",
                 kind: str = "") -> tuple[RunSetup, jax.stages.Compiled, dict]:
    """The train step of config items (files and KEY=VALUE) compiled for `devices` devices on
    `hosts` hosts: (its RunSetup, the compiled step, the compiler and kernels to report).
    compiler "cpu" sets this process's fake CPU device count (once per process) and compiles
    GPU_STAND_INS; "gpu" compiles the config's own kernels for deviceless GPUs of the cluster
    device `kind` (its configs/devices/ gpu_target), lowered inside kernel_device (tokamax's kernels
    are picked by the default device). ConfigError before compiling for an invalid layout or
    a missing GPU target or plugin."""
    files = [a for a in items if "=" not in a]
    overrides = [a for a in items if "=" in a]
    cfg, origins = load_config(files, [*overrides, *stand_in_overrides(compiler)])
    if compiler == "gpu":
        mesh_devices = gpu_aot.gpu_devices(devices, kind, hosts)
        kernels = {"compiler": "gpu", "gpu_target": kind,
                   "kernels": {"moe.grouped_matmul": cfg.moe.grouped_matmul,
                               "attention.implementation": cfg.attention.implementation}}
    else:
        jax.config.update("jax_num_cpu_devices", devices)
        mesh_devices = None
        kernels = {"compiler": "cpu", "stand_ins": {k: v for k, (v, _) in GPU_STAND_INS.items()}}
    sizes = validate(cfg, devices, origins, hosts)
    setup = prepare_run(cfg, sizes, mesh_devices)
    batch = abstract_batch(cfg, setup.trainer.batch_sharding)
    with use_mesh(setup.trainer.mesh, setup.trainer.rules), \
            kernel_device(setup.trainer.mesh.devices.flat):
        lowered = setup.trainer.jitted_step.lower(setup.trainer.abstract_state, batch)
    return setup, lowered.compile(), kernels


def compiled_figures(setup: RunSetup, compiled, devices_per_host: int,
                     hlo: str | None = None) -> dict:
    """The probe's figures (module docstring) of a compiled train step: what `maxmoe plan`
    measures on fake devices, and `maxmoe train` (plan.json, --dry-run) on the real ones."""
    cfg, trainer, sizes = setup.cfg, setup.trainer, setup.mesh_sizes
    devices = math.prod(sizes.values())
    hlo = compiled.as_text() if hlo is None else hlo  # the caller's text of `compiled`, if given
    parts = state_parts(trainer.abstract_state)
    replicated = replicated_leaves(trainer.abstract_state, devices)
    comm = collective_bytes(hlo, trainer.mesh, devices_per_host)
    batch = abstract_batch(cfg, trainer.batch_sharding)
    mesh = dict(sizes, **{f"dcn_{a}": getattr(cfg.mesh, f"dcn_{a}") for a in sizes})
    calls = kernel_calls(hlo)
    return {
        "devices": devices, "hosts": math.prod(mesh[f"dcn_{a}"] for a in sizes), "mesh": mesh,
        "remat": cfg.model.remat_policy, "microbatches": cfg.train.grad_accum_steps,
        "weights": cfg.mesh.weights,
        "memory": memory_analysis(compiled),
        "state": parts,
        "state_global_bytes": sum(math.prod(a.shape) * a.dtype.itemsize
                                  for a in jax.tree.leaves(trainer.abstract_state)),
        "batch_bytes": sum(leaf_bytes(b) for b in batch.values()),
        "grads_bytes": parts["params"],  # float32 gradients of the float32 params, as sharded
        "replicated_state_bytes": sum(b for _, b in replicated),
        "replicated": replicated[:20],
        "largest_buffers": largest_buffers(hlo),
        "cudnn_attention_calls": hlo.count("custom_call_target=\"__cudnn$fmha"),
        "kernel_calls": calls,
        "collectives": comm.by_axis, "collective_warnings": comm.warnings,
        "model_flops_per_step": setup.model_flops,
        "recompute_factor": (rerun := recompute_factor(cfg, sizes["pipeline"])),
        "flops_check": flops_check(hlo, compiled, setup.model_flops / devices, rerun),
        # the FP8 class's share (metrics.flops.MFU_CONVENTION; 0 with precision.fp8 none)
        "model_flops_fp8_per_step": 6.0 * fp8_params_per_token(cfg) * setup.tokens_per_step,
        # the same FLOPs by the kernel class that prices them (plan/roofline.price_compute)
        "model_flops_by_kernel_per_step": {k: f * setup.tokens_per_step
                                           for k, f in priced_flops(cfg, calls).items()},
        # the expert dispatch + combine as balanced routing sends them (None: not all_to_all or
        # two_level)
        "routed_dispatch_bytes": routed_dispatch_bytes(cfg, sizes, {
            a: mesh[f"dcn_{a}"] for a in sizes}),
        "tokens_per_step": setup.tokens_per_step,
        "bubble": pipeline_idle(cfg.model, sizes["pipeline"]),  # with chunk padding
        "pipelined_share": pipelined_share(cfg, sizes["pipeline"]),  # of the compute
    }


def child_env() -> dict[str, str]:
    """The parent's environment minus what would change the probe's devices: JAX on CPU only,
    no forced device count, no scheduler variables that would make it join a job."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "MAXMOE_COORDINATOR", "MAXMOE_NUM",
                                "MAXMOE_PROCESS", "JOBSET_", "JOB_COMPLETION"))}
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def run_probe(items: list[str], devices: int, hosts: int, devices_per_host: int,
              timeout_s: float = 900, compiler: str = "cpu", kind: str = "",
              cluster: Cluster | None = None, load_imbalance: float | None = None) -> dict:
    """measure() in a subprocess. Raises ConfigError for an invalid layout (the child's one
    line), ProbeFailed when the child dies or times out."""
    request = json.dumps({"items": items, "devices": devices, "hosts": hosts,
                          "devices_per_host": devices_per_host, "compiler": compiler,
                          "kind": kind, "cluster": cluster and dataclasses.asdict(cluster),
                          "load_imbalance": load_imbalance})
    t = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "maxmoe.plan.probe", request],
                              capture_output=True, text=True, env=child_env(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ProbeFailed(f"compiling {devices} devices took over {timeout_s:.0f} s") from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 2 and proc.stderr.strip():
        raise ConfigError(proc.stderr.strip().splitlines()[-1].removeprefix("maxmoe: error: "))
    if proc.returncode != 0 or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise ProbeFailed(f"the compile of {devices} devices exited {proc.returncode}: {tail}")
    result = json.loads(lines[-1])
    result["wall_s"] = round(time.perf_counter() - t, 1)
    return result


def main() -> int:
    request = json.loads(sys.argv[1])
    try:
        result = measure(request["items"], request["devices"], request["hosts"],
                         request["devices_per_host"], request.get("compiler", "cpu"),
                         request.get("kind", ""),
                         request.get("cluster") and Cluster(**request["cluster"]),
                         request.get("load_imbalance"))
    except ConfigError as e:
        print(f"maxmoe: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
