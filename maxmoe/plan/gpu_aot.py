"""Deviceless ahead-of-time compilation for NVIDIA GPUs: XLA:GPU's own buffer assignment,
kernel choices and collectives for a train step, on a machine without a GPU.

jaxlib's CUDA plugin (`pip install "jax[cuda12]"`, same version as jax) makes a compile-only
topology from a GPU target config (XLA's GpuTargetConfigProto in text form) and a
"partitions x hosts x devices-per-host" shape; its devices build a Mesh, and
`jit(f).lower(ShapeDtypeStructs).compile()` then runs the full XLA:GPU pipeline without
touching a device. Run with JAX_PLATFORMS=cpu on a GPU-less machine: the plugin then skips
its CUDA driver check and still registers its topology factory. docs/gpu_aot.md has the
findings and the limits (no autotuning, no cuDNN workspace sizes, kernels' `auto` picks).
"""

import importlib.util
import math
import re

import jax
from jax.experimental import topologies

from maxmoe.bench import memory_analysis
from maxmoe.config import ConfigError

# The figures XLA:GPU's cost models, tiling and scheduler memory limit read, per device kind
# (vendor data sheets; memory as the CUDA runtime reports it). Hopper only: the config says
# sm_90a. dnn_version_info below is a cuDNN 9 release: XLA gates cuDNN kernels by version.
TARGETS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", sm=(9, 0), cores=132, clock_ghz=1.98,
                 memory_bytes=84_942_979_072, bandwidth=3_352_320_000_000,
                 l2_bytes=52_428_800),
    "h200": dict(name="NVIDIA H200", sm=(9, 0), cores=132, clock_ghz=1.98,
                 memory_bytes=151_397_597_184, bandwidth=4_800_000_000_000,
                 l2_bytes=52_428_800),
}

# A cluster's device kind -> (its target in TARGETS, what the substitution means). The H800 is
# the H100's SM90 chip with the same SMs and HBM and a cut NVLink, which the compile never sees.
CLUSTER_TARGETS = {"h100": ("h100", ""),
                   "h800": ("h100", "the H100 target: same SM90 chip and 80 GB HBM, NVLink cut"),
                   "h200": ("h200", "")}


def cluster_target(kind: str) -> tuple[str, str]:
    """(TARGETS key, note) for a cluster's device kind; ConfigError for a kind without one."""
    if kind not in CLUSTER_TARGETS:
        raise ConfigError(f"--compiler gpu: cluster device kind {kind!r} has no GPU target; "
                          f"--compiler gpu supports {'/'.join(CLUSTER_TARGETS)} (use --compiler "
                          "cpu for the others)")
    return CLUSTER_TARGETS[kind]


def require_plugin() -> None:
    """Raises ConfigError (what to install) when jaxlib's CUDA plugin is not installed, so
    `maxmoe plan --compiler gpu` stops before any compile."""
    if importlib.util.find_spec("jax_plugins") is None or \
            importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        raise ConfigError(f'--compiler gpu needs the jax CUDA plugin: pip install '
                          f'"jax[cuda12]=={jax.__version__}" into the python that runs maxmoe '
                          '(no GPU needed; docs/gpu_aot.md)')


def target_config(kind: str) -> str:
    """GpuTargetConfigProto text for a device kind in TARGETS (Hopper: 228 KiB shared memory
    per SM, 64 Ki registers, 2048 threads); raises ConfigError for an unknown kind."""
    if kind not in TARGETS:
        raise ConfigError(f"GPU kind {kind!r} has no target config; use one of "
                          f"{sorted(TARGETS)} or add its figures to maxmoe/plan/gpu_aot.py")
    t = TARGETS[kind]
    info = {"threads_per_block_limit": 1024, "threads_per_warp": 32,
            "shared_memory_per_block": 49152, "shared_memory_per_block_optin": 232448,
            "shared_memory_per_core": 233472, "threads_per_core_limit": 2048,
            "core_count": t["cores"], "fpus_per_core": 128,
            "block_dim_limit_x": 2**31 - 1, "block_dim_limit_y": 65535,
            "block_dim_limit_z": 65535, "memory_bandwidth": t["bandwidth"],
            "l2_cache_size": t["l2_bytes"], "clock_rate_ghz": t["clock_ghz"],
            "device_memory_size": t["memory_bytes"], "registers_per_core_limit": 65536,
            "registers_per_block_limit": 65536}
    lines = [f"  {k}: {v}" for k, v in info.items()]
    major, minor = t["sm"]
    lines.append(f"  cuda_compute_capability {{ major: {major} minor: {minor} "
                 "feature_extension: ACCELERATED_FEATURES }")  # sm_90a: wgmma, TMA
    return ("gpu_device_info {\n" + "\n".join(lines) + "\n}\n" + 'platform_name: "CUDA"\n'
            "dnn_version_info { major: 9 minor: 8 patch: 0 }\n"
            f'device_description_str: "{t["name"]}"\n')


def gpu_devices(num_devices: int, kind: str = "h200", num_hosts: int = 1) -> list:
    """Compile-only devices of a deviceless CUDA topology: num_devices GPUs of `kind`, split
    evenly over num_hosts hosts (process_index 0..num_hosts-1), for jax.sharding.Mesh.
    Raises ConfigError when the CUDA plugin is not loaded or the split is uneven."""
    if num_devices < 1 or num_hosts < 1 or num_devices % num_hosts:
        raise ConfigError(f"GPU topology of {num_devices} devices on {num_hosts} hosts: need "
                          "num_devices a positive multiple of num_hosts")
    shape = f"1x{num_hosts}x{num_devices // num_hosts}"
    try:
        topology = topologies.get_topology_desc(
            "", "cuda", target_config=target_config(kind), topology=shape)
    except NotImplementedError as e:
        raise ConfigError(
            f"deviceless GPU compile: the jax CUDA plugin is not loaded ({e}); install "
            f'"jax[cuda12]=={jax.__version__}" and run with JAX_PLATFORMS=cpu') from e
    return list(topology.devices)


def gpu_memory_analysis(lowered: jax.stages.Lowered) -> dict[str, int]:
    """Compiles a function lowered on gpu_devices' mesh with XLA:GPU and returns its bytes
    per device (maxmoe.bench.memory_analysis's keys: arguments, outputs, temps, peak)."""
    return memory_analysis(lowered.compile())


_ARRAY = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]")


def dense_expansions(hlo_text: str, local_experts: int, expert_elements: int) -> list[str]:
    """The arrays of the MoE grouped matmul (op_name scope "grouped_matmul") in compiled HLO
    that are shaped like a dense expansion, every routed row through every local expert (what
    XLA's RaggedDotRewriter builds from lax.ragged_dot): rank >= 3, `local_experts` as one of
    the first two dims, and more elements per expert than one expert's weight
    (`expert_elements`, D x F). Weights and their gradients ([El, D, F] at most) are not."""
    found = set()
    for line in hlo_text.splitlines():
        m = _ARRAY.match(line)
        if not m or "grouped_matmul" not in line:
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        if (len(dims) >= 3 and local_experts in dims[:2]
                and math.prod(dims) // local_experts > expert_elements):
            found.add(f"{m.group(1)}{dims}")
    return sorted(found)


def score_matrices(hlo_text: str, seq_len: int) -> list[str]:
    """Floating-point arrays in compiled HLO whose last two dims are seq_len x seq_len:
    attention scores materialised (a flash kernel keeps them on chip)."""
    found = set()
    for line in hlo_text.splitlines():
        m = _ARRAY.match(line)
        if not m or m.group(1) not in ("f32", "bf16", "f16"):
            continue
        dims = [int(d) for d in m.group(2).split(",") if d]
        if len(dims) >= 2 and dims[-2:] == [seq_len, seq_len]:
            found.add(f"{m.group(1)}{dims}")
    return sorted(found)
