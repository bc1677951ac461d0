"""Deviceless XLA:GPU compiles (skipped where jaxlib's CUDA plugin is not installed)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxmoe.config import ConfigError
from maxmoe.metrics.flops import recompute_factor
from maxmoe.plan.compiled_flops import flops_check
from maxmoe.plan.gpu_aot import gpu_devices, gpu_memory_analysis, target_config
from maxmoe.plan.probe import compile_step, run_probe

pytest.importorskip("jax_plugins.xla_cuda12", reason="jax[cuda12] plugin not installed")
pytestmark = pytest.mark.gpu_aot


def test_sharded_matmul_has_gpu_buffer_assignment():
    devices = gpu_devices(2, "h200")
    assert [d.platform for d in devices] == ["gpu", "gpu"]
    mesh = Mesh(devices, ("x",))
    rows = NamedSharding(mesh, P("x", None))
    whole = NamedSharding(mesh, P())
    a = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=rows)
    b = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=whole)
    lowered = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b.T, out_shardings=rows).lower(a, b)
    mem = gpu_memory_analysis(lowered)
    # reference: each device holds half of a's rows and all of b, in bfloat16 (2 bytes)
    assert mem["argument_bytes"] == (2048 * 1024 + 1024 * 1024) * 2
    assert mem["output_bytes"] == 2048 * 1024 * 2
    assert mem["peak_bytes"] >= mem["argument_bytes"] + mem["output_bytes"]
    hlo = lowered.compile().as_text()
    assert "__cublas" in hlo or "gemm_fusion" in hlo  # GPU kernels: XLA:CPU emits neither


def test_ragged_all_to_all_compiles_for_gpu():
    """XLA:CPU cannot compile ragged_all_to_all; XLA:GPU can, without a device."""
    mesh = Mesh(gpu_devices(4), ("x",))

    def body(x, out, offsets, send, out_offsets, recv):
        return jax.lax.ragged_all_to_all(x, out, offsets, send, out_offsets, recv,
                                         axis_name="x")

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
    x = jax.ShapeDtypeStruct((4 * 256, 64), jnp.float32, sharding=NamedSharding(mesh, P("x")))
    idx = jax.ShapeDtypeStruct((16,), jnp.int32, sharding=NamedSharding(mesh, P("x")))
    compiled = step.lower(x, x, idx, idx, idx, idx).compile()
    assert "ragged-all-to-all" in compiled.as_text()


def test_hosts_and_errors():
    """Fake GPU devices are split evenly over num_hosts (process_index) and carry the kind's
    CUDA device name; a host count that does not divide the devices, a kind without a gpu_target
    and an unknown kind are ConfigErrors naming the problem."""
    devices = gpu_devices(8, "h100", num_hosts=2)
    assert [d.process_index for d in devices] == [0] * 4 + [1] * 4
    assert {d.device_kind for d in devices} == {"NVIDIA H100 80GB HBM3"}
    with pytest.raises(ConfigError, match="num_hosts"):
        gpu_devices(6, num_hosts=4)
    with pytest.raises(ConfigError, match="'a100' has no gpu_target"):
        target_config("a100")  # configs/devices/a100.yaml has peaks but no gpu_target
    with pytest.raises(ConfigError, match="'tpu9': unknown"):
        target_config("tpu9")
    for kind, name in [("h800", "NVIDIA H800"), ("b200", "NVIDIA B200")]:  # their own targets
        assert {d.device_kind for d in gpu_devices(2, kind)} == {name}


@pytest.mark.slow
def test_plan_gpu_compiler_end_to_end_matches_cpu_state():
    """`maxmoe plan --compiler gpu`'s probe on tiny (bfloat16), 8 x H200: XLA:GPU's figures,
    with the same train state per device as the XLA:CPU compile (the sharding is the same),
    and the GPU's own kernels (auto: tokamax's Mosaic kernels) where the CPU has stand-ins."""
    pytest.importorskip("tokamax", reason="tokamax not installed")
    items = ["configs/tiny.yaml", "precision.compute_dtype=bfloat16"]
    gpu = run_probe(items, 8, 1, 8, compiler="gpu", kind="h200")
    cpu = run_probe(items, 8, 1, 8, compiler="cpu")
    assert (gpu["compiler"], gpu["gpu_target"], cpu["compiler"]) == ("gpu", "h200", "cpu")
    assert gpu["memory"]["argument_bytes"] == cpu["memory"]["argument_bytes"]
    assert gpu["state"] == cpu["state"]
    assert gpu["memory"]["peak_bytes"] >= gpu["memory"]["argument_bytes"]
    assert gpu["kernels"] == {"moe.grouped_matmul": "auto", "attention.implementation": "auto"}
    for part in ("moe grouped matmul", "attention"):  # GPU kernels vs the CPU stand-ins
        assert "mosaic_gpu_v2" in gpu["kernel_calls"][part]
        assert "mosaic_gpu_v2" not in cpu["kernel_calls"].get(part, {})
    # compiled vs model FLOPs: the Mosaic kernels' FLOPs are not in the HLO (a lower bound, said
    # so); the CPU stand-in's block loops have data-dependent trip counts (not judged)
    check = gpu["flops_check"]
    assert check["verdict"] == "within (a lower bound)" and check["flag"] is False, check
    assert check["uncounted_custom_calls"]["mosaic_gpu_v2"] > 0 and check["ratio"] < 1
    assert cpu["flops_check"]["verdict"] == "not judged", cpu["flops_check"]


@pytest.mark.slow
def test_compiled_flops_flag_a_dense_ragged_dot():
    """tiny (bfloat16) with moe.grouped_matmul=ragged_dot on 8 deviceless H100s: XLA's
    RaggedDotRewriter runs every row through all 4 local experts, and the check flags it (over
    1.2x the model's FLOPs per device; the ratio: docs/gpu_aot.md, compiled FLOPs)."""
    items = ["configs/tiny.yaml", "precision.compute_dtype=bfloat16",
             "moe.grouped_matmul=ragged_dot"]
    setup, compiled, _ = compile_step(items, 8, 1, "gpu", "h100")
    check = flops_check(compiled.as_text(), compiled, setup.model_flops / 8,
                        recompute_factor(setup.cfg, 1))
    assert check["flag"] is True and check["ratio"] > 2, check
    assert check["loops_counted_once"] == 0
