"""The train step compiled by XLA:GPU for 8 deviceless H100s (plan/gpu_aot.py), with the kernels
`auto` picks there: the MoE's grouped GEMMs and attention must be tokamax's Mosaic GPU custom
calls, with no dense-expansion buffer and no S x S float scores. The `gpu_aot` group (marker);
skipped without jax's CUDA plugin or tokamax (`pip install -e ".[cuda,test]"`, Python >= 3.12).

Layouts: tiny (GQA, head dim 32) on 2 fsdp x 2 expert x 2 tensor; tiny DeepSeek-V3 with
DeepSeek-V3's MLA head dims (q/k 192, v 128) on 2 data x 2 expert x 2 tensor, the expert axis
across 2 hosts (so the all-to-all runs as ragged_all_to_all); tiny again with
precision.fp8=blockwise. Every while loop must have a known trip count (no host sync per trip). The checks are shown to fail on lax.ragged_dot, on
XLA attention at head dim 192 and on a loop bounded by an array.
"""

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="jax[cuda12] plugin not installed")
pytest.importorskip("tokamax", reason="tokamax not installed")

from maxmoe.plan.gpu_aot import (  # noqa: E402
    dense_expansions,
    gpu_devices,
    score_matrices,
    unknown_trip_loops,
)
from maxmoe.plan.probe import compile_step, kernel_calls, priced_flops  # noqa: E402

pytestmark = pytest.mark.gpu_aot

BF16 = "precision.compute_dtype=bfloat16"  # the GPU default; the Mosaic kernels take no f32
SEQ = "data.seq_len=384"  # no other dim of these models is 384: S x S arrays are scores
TINY = (["configs/tiny.yaml", "configs/mesh/cpu8_fsdp_expert_tensor.yaml", BF16, SEQ], 1)
V3_192 = (["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml", BF16,
           "attention.qk_nope_head_dim=128", "attention.qk_rope_head_dim=64",
           "attention.v_head_dim=128", SEQ, "data.global_batch_size=8",
           "mesh.data=2", "mesh.fsdp=1", "mesh.expert=2", "mesh.tensor=2", "mesh.dcn_expert=2"],
          2)
SHORTER = "model.num_layers=2"  # the failure cases: one MoE layer is enough
FP8 = "precision.fp8=blockwise"


def compiled_hlo(case, *overrides):
    """(optimised HLO text, config, mesh sizes) of the case's train step on 8 H100s."""
    items, hosts = case
    setup, compiled, _ = compile_step([*items, *overrides], 8, hosts, "gpu", "h100")
    return compiled.as_text(), setup.cfg, setup.mesh_sizes


def problems(hlo: str, cfg, sizes) -> list[str]:
    """What keeps the compiled step off the GPU kernels (empty: none)."""
    calls, out = kernel_calls(hlo), []
    for part in ("moe grouped matmul", "attention"):
        kinds = calls.get(part, {})
        if not any(k.startswith("mosaic_gpu") for k in kinds):
            out.append(f"{part}: no Mosaic GPU custom call ({kinds})")
        if kinds.get("dot"):
            out.append(f"{part}: {kinds['dot']} XLA dots")
    dense = dense_expansions(hlo, cfg.moe.num_experts // sizes["expert"],
                             cfg.model.hidden_size * cfg.moe.expert_mlp_size)
    if dense:
        out.append(f"dense-expansion buffers {dense}")
    scores = score_matrices(hlo, cfg.data.seq_len)
    if scores:
        out.append(f"S x S float scores {scores}")
    loops = unknown_trip_loops(hlo)
    if loops:
        out.append(f"while loops without a known trip count (a host sync each trip) {loops}")
    return out


def test_tiny_runs_mosaic_grouped_gemms_and_flash_attention():
    hlo, cfg, sizes = compiled_hlo(TINY)
    assert sizes["fsdp"] == sizes["expert"] == sizes["tensor"] == 2
    assert problems(hlo, cfg, sizes) == []


def test_tiny_deepseek_v3_head_dim_192_across_two_hosts():
    hlo, cfg, sizes = compiled_hlo(V3_192)
    assert cfg.attention.qk_nope_head_dim + cfg.attention.qk_rope_head_dim == 192
    assert sizes["data"] == sizes["expert"] == sizes["tensor"] == 2
    assert problems(hlo, cfg, sizes) == []
    assert "ragged-all-to-all" in hlo  # the expert axis spans the 2 hosts


def test_checks_fail_on_lax_ragged_dot():
    hlo, cfg, sizes = compiled_hlo(TINY, SHORTER, "moe.grouped_matmul=ragged_dot")
    found = problems(hlo, cfg, sizes)
    assert any(p.startswith("moe grouped matmul: no Mosaic") for p in found), found
    assert any(p.startswith("dense-expansion buffers") for p in found), found


def test_checks_fail_on_xla_attention_at_head_dim_192():
    # fused: jax.nn.dot_product_attention, whose cuDNN kernel refuses head dim 192 (XLA then)
    hlo, cfg, sizes = compiled_hlo(V3_192, SHORTER, "attention.implementation=fused")
    found = problems(hlo, cfg, sizes)
    assert any(p.startswith("attention: no Mosaic") for p in found), found
    assert any(p.startswith("S x S float scores") for p in found), found


def test_trip_count_check_fires_on_a_data_dependent_loop():
    """A fori_loop bounded by an array (what the all-to-all rounds were) compiles for XLA:GPU
    to a while without known_trip_count; bounded by a Python int, it has one."""
    def run(bound):
        def f(n, x):
            return jax.lax.fori_loop(0, n if bound is None else bound, lambda i, y: y * 1.5 + i, x)
        one = jax.sharding.SingleDeviceSharding(gpu_devices(1, "h100")[0])
        args = (jax.ShapeDtypeStruct((), jnp.int32, sharding=one),
                jax.ShapeDtypeStruct((1024,), jnp.float32, sharding=one))
        return jax.jit(f).lower(*args).compile().as_text()
    found = unknown_trip_loops(run(None))
    assert len(found) == 1 and "while" in found[0], found
    static = run(7)
    assert '"known_trip_count":{"n":"7"}' in static and unknown_trip_loops(static) == []


def test_grouped_gemm_takes_rows_not_a_multiple_of_its_tile():
    """tokamax's Mosaic grouped GEMM refuses 96 rows (SM90's row tile is 64: "dimension 1 must
    have size smaller or a multiple of its tiling 64"), which 4 token chunks of the DeepSeek
    recipe at tiny size give (tests/plan/test_gpu_outer_rows.py); tokamax_ops pads the rows
    to ROW_TILE. Forward and both gradients lower and compile for one deviceless H100."""
    from maxmoe.kernels import tokamax_ops
    one = jax.sharding.SingleDeviceSharding(gpu_devices(1, "h100")[0])
    args = [jax.ShapeDtypeStruct(s, t, sharding=one) for s, t in
            (((96, 128), jnp.bfloat16), ((2, 128, 64), jnp.bfloat16), ((2,), jnp.int32))]

    def loss(x, w, sizes):
        return tokamax_ops.ragged_dot(x, w, sizes).astype(jnp.float32).sum()
    with tokamax_ops.kernel_device(one.device_set):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args)
    hlo = lowered.compile().as_text()
    assert hlo.count("mosaic_gpu") >= 2, "no Mosaic grouped kernel compiled"


def test_tiny_fp8_blockwise_projections_run_fp8_experts_dequantised():
    """precision.fp8=blockwise (tiny, one dense and one MoE layer): the attention projections',
    dense MLP's and shared experts' GEMMs take f8e4m3fn operands (XLA:GPU writes them as
    Triton GEMM fusions here, no cuBLASLt FP8 custom call); the routed experts run docs/
    gpu_aot.md's SM90 row: tokamax's Mosaic grouped kernels on dequantised bf16 operands, so
    no FP8 dot there, the E4M3 rounding kept as reduce-precision ops, no dense expansion."""
    # late: tools/ is not a package of maxmoe (tests/convert imports its helpers the same way)
    from tools.fp8_hlo import fp8_counts
    hlo, cfg, sizes = compiled_hlo(TINY, SHORTER, FP8)
    assert cfg.precision.fp8 == "blockwise" and problems(hlo, cfg, sizes) == []
    for part in ("attention/projection", "/mlp/", "moe/shared_experts"):
        counts = fp8_counts(hlo, part)
        assert counts["f8_dots"] == counts["dots"] > 0, (part, counts)
    experts = fp8_counts(hlo, "grouped_matmul")
    assert experts["f8_dots"] == experts["f8_ragged_dots"] == 0, experts
    # so the plan prices them at the bf16 peak, the other FP8 GEMMs at the FP8 one
    priced = priced_flops(cfg, kernel_calls(hlo))
    assert priced["routed_fp8"] == 0 < priced["routed_bf16"] and priced["gemm_fp8"] > 0, priced
    assert any("reduce-precision(" in line and "grouped_matmul" in line
               for line in hlo.splitlines())
