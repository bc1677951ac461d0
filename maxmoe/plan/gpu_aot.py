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

import importlib.metadata
import importlib.util
import math
import re

import jax
from jax.experimental import topologies

from maxmoe.bench import memory_analysis
from maxmoe.cluster import gpu_target, known_kinds
from maxmoe.config import ConfigError
from maxmoe.plan.hlo import attr, known_trip_count, parse_instruction, parse_module

# Per-SM limits of the SM90 (Hopper) and SM100 (Blackwell) targets: the same figures in XLA's own
# h100_sxm, h200 and b200 specs (openxla/xla xla/backends/gpu/target_config/specs/): 228 KiB
# shared memory per SM (227 KiB a block opted in), 64 Ki registers, 2048 threads. The per-device
# figures (SMs, clock, memory, bandwidth, L2) come from configs/devices/KIND.yaml's gpu_target.
SM_LIMITS = {"threads_per_block_limit": 1024, "threads_per_warp": 32,
             "shared_memory_per_block": 49152, "shared_memory_per_block_optin": 232448,
             "shared_memory_per_core": 233472, "threads_per_core_limit": 2048,
             "fpus_per_core": 128, "block_dim_limit_x": 2**31 - 1, "block_dim_limit_y": 65535,
             "block_dim_limit_z": 65535, "registers_per_core_limit": 65536,
             "registers_per_block_limit": 65536}
SM_MAJORS = (9, 10)  # the compute capabilities SM_LIMITS holds for
# the cuDNN wheel jax[cuda12] installs; XLA gates its cuDNN kernels by the declared version
CUDNN_WHEEL = "nvidia-cudnn-cu12"


def target_kinds() -> list[str]:
    """Device kinds whose configs/devices/ file has a gpu_target (the deviceless compile's)."""
    return [k for k in known_kinds() if gpu_target(k) is not None]


def require_target(kind: str) -> dict:
    """configs/devices/KIND.yaml's gpu_target; ConfigError for a kind without one (or with a
    compute capability SM_LIMITS does not cover), so `maxmoe plan --compiler gpu` stops first."""
    target = gpu_target(kind)
    if target is None:
        raise ConfigError(f"--compiler gpu: device kind {kind!r} has no gpu_target in "
                          f"configs/devices/{kind}.yaml; kinds with one: "
                          f"{', '.join(target_kinds())} (use --compiler cpu, or add its "
                          "gpu_target: figures with their source)")
    major, minor, _ = target["compute_capability"]
    if major not in SM_MAJORS:
        raise ConfigError(f"--compiler gpu: device kind {kind!r} is SM{major}{minor}; the "
                          f"deviceless target knows the per-SM limits of SM"
                          f"{'/SM'.join(f'{m}0' for m in SM_MAJORS)} only (use --compiler cpu)")
    return target


def require_plugin() -> None:
    """Raises ConfigError (what to install) when jaxlib's CUDA plugin is not installed, so
    `maxmoe plan --compiler gpu` stops before any compile."""
    if not plugin_installed():
        raise ConfigError(f'--compiler gpu needs the jax CUDA plugin: pip install '
                          f'"jax[cuda12]=={jax.__version__}" into the python that runs maxmoe '
                          '(no GPU needed; docs/gpu_aot.md)')


def plugin_installed() -> bool:
    """Whether jaxlib's CUDA 12 plugin (jax_plugins.xla_cuda12) is importable here."""
    return (importlib.util.find_spec("jax_plugins") is not None
            and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None)


def cudnn_version() -> tuple[int, int, int]:
    """(major, minor, patch) of the installed cuDNN wheel (CUDNN_WHEEL), which the target config
    declares; ConfigError naming the install when it is absent."""
    try:
        version = importlib.metadata.version(CUDNN_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"deviceless GPU compile: the {CUDNN_WHEEL} wheel is not installed, and "
                          "the target declares its cuDNN version (XLA picks cuDNN kernels by "
                          f'it); pip install "jax[cuda12]=={jax.__version__}"') from None
    parts = [int(p) for p in re.findall(r"\d+", version)[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def target_config(kind: str) -> str:
    """GpuTargetConfigProto text for a device kind with a gpu_target in configs/devices/
    (require_target), declaring the installed cuDNN (cudnn_version); raises ConfigError for a
    kind without one or without the cuDNN wheel."""
    t = require_target(kind)
    info = dict(SM_LIMITS, core_count=t["sm_count"], memory_bandwidth=t["memory_bandwidth"],
                l2_cache_size=t["l2_cache_bytes"], clock_rate_ghz=t["clock_ghz"],
                device_memory_size=t["memory_bytes"])
    lines = [f"  {k}: {v}" for k, v in info.items()]
    major, minor, accelerated = t["compute_capability"]
    extension = "ACCELERATED_FEATURES" if accelerated else "NONE"  # sm_90a: wgmma, TMA
    lines.append(f"  cuda_compute_capability {{ major: {major} minor: {minor} "
                 f"feature_extension: {extension} }}")
    dnn = dict(zip(("major", "minor", "patch"), cudnn_version(), strict=True))
    return ("gpu_device_info {\n" + "\n".join(lines) + "\n}\n" + 'platform_name: "CUDA"\n'
            "dnn_version_info { " + " ".join(f"{k}: {v}" for k, v in dnn.items()) + " }\n"
            f'device_description_str: "{t["device_name"]}"\n')


def gpu_devices(num_devices: int, kind: str = "h200", num_hosts: int = 1) -> list:
    """Compile-only devices of a deviceless CUDA topology: num_devices GPUs of device `kind`
    (configs/devices/KIND.yaml's gpu_target), split
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


def unknown_trip_loops(hlo_text: str) -> list[str]:
    """The while loops in compiled XLA:GPU HLO without a known trip count: "name (op_name)"
    each. XLA:GPU writes "known_trip_count" in a while's backend_config when it proves the
    count (plan/hlo.known_trip_count); without it, every iteration copies the loop predicate
    to the host and waits."""
    found = []
    for line in hlo_text.splitlines():
        ins = parse_instruction(line)
        if ins is not None and ins.opcode == "while" and known_trip_count(ins) is None:
            op = attr(ins.attrs, "metadata") or ""
            name = re.search(r'op_name="([^"]*)"', op)
            found.append(f"{ins.name} ({name.group(1) if name else 'no op_name'})")
    return sorted(found)


# the MoE grouped GEMM's scope (kernels/grouped_matmul.py): the expert compute an exchange of
# another token chunk can hide under (moe.overlap_chunks)
_GROUPED_SCOPE = "grouped_matmul"
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                "collective-permute")


def ragged_exchanges(hlo_text: str) -> list[dict]:
    """Each ragged all-to-all of scheduled XLA:GPU HLO, in schedule order: {"name", "async" (a
    start/done pair not marked is_sync), "ops_between" (instructions with device work scheduled
    strictly between its start and done: fusions, custom calls, other collectives' starts),
    "gemms_between" (those of them in the MoE grouped GEMM's scope), "starts_between" (other
    collectives started meanwhile: in flight together), "replica_groups" (as printed)}. A
    synchronous one has nothing between it and its result, so it runs exposed
    (plan/overlap.py)."""
    found = []
    for instrs in parse_module(hlo_text)[0].values():
        open_ = {}
        for ins in instrs:
            if ins.opcode == "ragged-all-to-all-done":
                open_.pop(ins.operands[0].split()[-1].lstrip("%"), None)
            elif ins.opcode in ("fusion", "custom-call") or ins.opcode.endswith("-start"):
                for row in open_.values():
                    row["ops_between"] += 1
                    row["gemms_between"] += _GROUPED_SCOPE in (attr(ins.attrs, "metadata") or "")
                    row["starts_between"] += ins.opcode.removesuffix("-start") in _COLLECTIVES
            if ins.opcode in ("ragged-all-to-all", "ragged-all-to-all-start"):
                start = ins.opcode.endswith("-start")
                row = {"name": ins.name, "async": start and '"is_sync":true' not in ins.attrs,
                       "ops_between": 0, "gemms_between": 0, "starts_between": 0,
                       "replica_groups": attr(ins.attrs, "replica_groups")}
                found.append(row)
                if start:
                    open_[ins.name] = row
    return found
