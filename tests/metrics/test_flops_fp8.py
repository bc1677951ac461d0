"""MFU per matmul class under precision.fp8 (metrics.flops.MFU_CONVENTION, issue 28 item 5):
the causal FLOP count split into an FP8 and a BF16 class, each against its own peak; with
fp8 = none every figure is what it was before the split."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from maxmoe.bench import memory_line, mfu_figures
from maxmoe.cluster import load_cluster
from maxmoe.config_files import load_config
from maxmoe.kernels.fp8 import fp8_dot
from maxmoe.metrics import flops as flops_module
from maxmoe.metrics.flops import (
    KERNEL_CLASSES,
    effective_peak,
    flops_by_kernel,
    flops_by_precision,
    flops_per_token,
    fp8_params_per_token,
    fp8_peak_flops,
    mfu,
    peak_flops,
)
from maxmoe.plan.roofline import (
    V3_FLOPS_PER_TOKEN,
    V3_FP8_FLOPS_PER_TOKEN,
    price_compute,
    step_time,
)
from maxmoe.train.reporting import log_window

TINY_V3 = ["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml"]
PRESETS = [TINY_V3, ["configs/tiny.yaml", "configs/models/tiny_mixtral.yaml"]]


def tiny_v3(fp8: str):
    cfg, _ = load_config(TINY_V3, [f"precision.fp8={fp8}", "precision.compute_dtype=bfloat16"])
    return cfg


@pytest.mark.parametrize("preset", PRESETS)
def test_fp8_none_is_all_bf16_and_mfu_unchanged(preset):
    cfg, _ = load_config(preset)
    assert cfg.precision.fp8 == "none"
    split = flops_by_precision(cfg)
    assert split == {"bf16": flops_per_token(cfg), "fp8": 0.0}
    total, seconds, peaks = flops_per_token(cfg) * 4096, 0.37, {"bf16": 3.1e11, "fp8": 9e99}
    flops = {c: f * 4096 for c, f in split.items()}
    assert effective_peak(flops, peaks) == 3.1e11
    assert mfu(flops, seconds, peaks) == total / seconds / 3.1e11  # bit for bit, as before


def test_tiny_v3_split_by_hand():
    """configs/tiny.yaml + tiny_deepseek_v3 (d 128, 1 dense + 3 MoE layers, MLA with q_lora 64,
    kv_lora 32, 4 heads of nope 32 / rope 16 / v 32, 8 experts of 64, top-2 + 1 shared, one
    MTP depth), counted by hand per token."""
    cfg = tiny_v3("blockwise")
    m, a = cfg.model, cfg.attention
    assert (m.hidden_size, m.num_layers, m.num_dense_layers, m.mtp_depth) == (128, 4, 1, 1)
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim,
            a.v_head_dim, a.num_heads) == (64, 32, 32, 16, 32, 4)
    v, s = m.vocab_size, cfg.data.seq_len
    # projections: q_a 128x64 + q_b 64x4x48 + kv_a 128x32 + k_rope 128x16 + k_nope 32x4x32
    # + v 32x4x32 + o 4x32x128 = 8192 + 12288 + 4096 + 2048 + 4096 + 4096 + 16384
    attn = 51200
    dense, experts = 3 * 128 * 256, 3 * 128 * 64 * 3  # 98304; (top-2 + shared) 73728
    fp8 = (attn + dense) + 3 * (attn + experts) + (attn + experts)  # 3 MoE layers + MTP block
    assert fp8 == 649216 and fp8_params_per_token(cfg) == fp8
    # BF16: per layer 2 pre-norms + MLA's q_a / kv_a norms (256 + 96), routers 128x8 on the MoE
    # layers, final norm, LM head; MTP: its block's norms and router, the 256x128 projection,
    # its 3 norms and the LM head again; attention core 6 x 5 layers x 4 heads x 80 x S / 2
    bf16_params = 4 * 352 + 3 * 1024 + 128 + 128 * v + 352 + 1024 + 2 * 128 * 128 + 384 + 128 * v
    split = flops_by_precision(cfg)
    assert split["fp8"] == 6 * fp8
    assert split["bf16"] == 6 * bf16_params + 6 * 5 * 4 * 80 * s / 2
    assert split["bf16"] + split["fp8"] == flops_per_token(cfg)  # exactly, same total
    assert flops_per_token(cfg) == flops_per_token(tiny_v3("none"))
    assert fp8_params_per_token(tiny_v3("tensorwise")) == fp8


@pytest.mark.parametrize("fp8", ["none", "blockwise"])
def test_tiny_v3_split_by_kernel_by_hand(fp8):
    """The planner's pricing classes (flops_by_kernel): the routed experts are top-2 x 3 x 128
    x 64 per MoE layer, 3 MoE layers + the MTP block; the attention core 6 x 5 layers x 4 heads
    x (48 + 32) x S / 2; the other GEMMs the rest of their precision's class."""
    cfg = tiny_v3(fp8)
    s = cfg.data.seq_len
    routed = 6 * 4 * 2 * 3 * 128 * 64
    attention = 6 * 5 * 4 * 80 * s / 2
    split, by_precision = flops_by_kernel(cfg), flops_by_precision(cfg)
    assert set(split) == set(KERNEL_CLASSES)
    assert split["attention"] == attention
    assert split[f"routed_{'bf16' if fp8 == 'none' else 'fp8'}"] == routed
    assert split["routed_bf16"] + split["routed_fp8"] == routed
    assert split["gemm_fp8"] == by_precision["fp8"] - split["routed_fp8"]
    assert split["gemm_bf16"] == by_precision["bf16"] - attention - split["routed_bf16"]
    assert sum(split.values()) == flops_per_token(cfg)  # exactly, the same total


def test_dequantised_routed_experts_are_priced_in_16_bit():
    """routed_in_fp8 False (the grouped kernel runs FP8's values in bf16 math: tokamax on
    SM90): under blockwise the routed FLOPs move to routed_bf16, the other FP8 GEMMs stay
    gemm_fp8, the total is unchanged; without FP8 it changes nothing."""
    cfg = tiny_v3("blockwise")
    routed = 6 * 4 * 2 * 3 * 128 * 64
    fp8, deq = flops_by_kernel(cfg), flops_by_kernel(cfg, routed_in_fp8=False)
    assert deq["routed_fp8"] == 0 and deq["routed_bf16"] == fp8["routed_fp8"] == routed
    assert deq["gemm_fp8"] == fp8["gemm_fp8"] > 0 and deq["gemm_bf16"] == fp8["gemm_bf16"]
    assert sum(deq.values()) == flops_per_token(cfg)
    assert flops_by_kernel(tiny_v3("none"), routed_in_fp8=False) == flops_by_kernel(
        tiny_v3("none"))


def test_mfu_denominator_follows_the_classes():
    """3 s for 6e12 bf16-class + 12e12 fp8-class FLOPs on peaks 1e12 / 4e12: the classes need
    6 + 3 = 9 s at peak, so MFU is 9 / 3 = 3 (a made-up peak, to check the arithmetic); over the
    bf16 peak alone it would be 18 / 3 = 6, over the fp8 peak alone 1.5."""
    flops, peaks = {"bf16": 6e12, "fp8": 12e12}, {"bf16": 1e12, "fp8": 4e12}
    assert mfu(flops, 3.0, peaks) == pytest.approx(3.0, rel=1e-12)
    assert effective_peak(flops, peaks) == pytest.approx(18e12 / 9, rel=1e-12)


def fake_setup(cfg, tokens: int = 2048):
    return SimpleNamespace(cfg=cfg, tokens_per_step=tokens,
                           model_flops=flops_per_token(cfg) * tokens)


def test_bench_mfu_figures():
    """mfu_figures: with fp8 none, MFU is model FLOPs / time / the bf16 peak and no FLOP is
    FP8-class; with blockwise FP8 the FP8-class FLOPs (6 x tiny V3's 649216 FP8 params per token
    x 2048 tokens) are priced at the FP8 peak, the rest at bf16's, and that MFU lies between the
    figures against either peak alone (rel 1e-12)."""
    base = mfu_figures(fake_setup(tiny_v3("none")), 0.5, (1e12, "bf16 sheet"), (2e12, "fp8 sheet"))
    setup = fake_setup(tiny_v3("none"))
    assert base["mfu"] == setup.model_flops / 0.5 / 1e12 == base["mfu_vs_bf16_peak"]
    assert base["model_flops_fp8_per_step"] == 0
    setup = fake_setup(tiny_v3("blockwise"))
    r = mfu_figures(setup, 0.5, (1e12, "bf16 sheet"), (2e12, "fp8 sheet"))
    fp8 = 6 * 649216 * 2048
    assert r["model_flops_fp8_per_step"] == fp8
    want = ((setup.model_flops - fp8) / 1e12 + fp8 / 2e12) / 0.5
    assert r["mfu"] == pytest.approx(want, rel=1e-12)
    assert r["mfu_vs_bf16_peak"] > r["mfu"] > r["mfu_vs_fp8_peak"]
    assert r["mfu_vs_fp8_peak"] == pytest.approx(r["mfu_vs_bf16_peak"] / 2, rel=1e-12)


@pytest.mark.parametrize("fp8", ["none", "blockwise"])
def test_training_loop_mfu_counts_as_bench(fp8, monkeypatch):
    """The training loop's MFU (metrics.jsonl, the progress bar) on an H200 (data sheets faked
    in: bf16 989e12, fp8 1979e12 FLOP/s a device) equals bench's mfu_figures: FP8-class FLOPs
    at the FP8 peak. Counting every FLOP at the bf16 peak (the old loop) gives
    mfu_vs_bf16_peak, which differs by the FP8 share (tiny V3: 649216 of its params per token)."""
    sheets = {"bf16": ("H200", 989e12), "fp8": ("H200", 1979e12)}
    monkeypatch.setattr(flops_module, "_data_sheet_peak", lambda precision="bf16": (
        sheets[precision][1] * 1.0, f"{sheets[precision][0]} {precision} data-sheet peak"))
    setup = fake_setup(tiny_v3(fp8))
    window = log_window(setup)  # LogWindow.close: mfu = model FLOPs / step time / window.peak
    n, seconds = jax.device_count(), 0.5
    want = mfu_figures(setup, seconds, (989e12 * n, "bf16"), (1979e12 * n, "fp8"))
    assert setup.model_flops / seconds / window.peak == pytest.approx(want["mfu"], rel=1e-12)
    if fp8 == "none":
        assert want["mfu"] == pytest.approx(want["mfu_vs_bf16_peak"], rel=1e-12)
    else:
        assert want["mfu"] < 0.9 * want["mfu_vs_bf16_peak"], want


def test_cpu_fp8_peak_falls_back_to_the_bf16_one():
    cfg, _ = load_config(["configs/tiny.yaml"], ["logging.peak_flops_per_device=1e12"])
    bf16 = peak_flops(cfg)
    rate, source = fp8_peak_flops(cfg, bf16)
    assert rate == bf16[0] and "no fp8 peak known" in source


def test_memory_line_says_what_fp8_saves():
    memory = dict(peak_bytes=2**30, argument_bytes=2**29, output_bytes=2**29, alias_bytes=2**29,
                  temp_bytes=2**29)
    assert "fp8" not in memory_line(memory)
    assert "fp8 blockwise: none saved" in memory_line(memory, "blockwise")
    assert "E4M3 (half their bf16 bytes" in memory_line(memory, "tensorwise")


def test_planner_prices_fp8_at_the_fp8_peak_and_its_kernel_efficiency():
    """V3's FP8 share, recomputed from its config, is the constant roofline states; an FP8 plan
    of V3 on 2048xh800 runs its FP8 GEMMs at the fp8 peak x the h800 file's FP8 GEMM efficiency
    and the rest at the bf16 peak x theirs (no DeepSeek end-to-end rate in it), and fp8 = none
    plans every FLOP at the bf16 peak, as MFU counts it."""
    cfg, _ = load_config(["configs/models/deepseek_v3_671b.yaml"],
                         ["data.seq_len=4096", "precision.fp8=blockwise"])
    assert flops_per_token(cfg) == V3_FLOPS_PER_TOKEN
    assert 6 * fp8_params_per_token(cfg) == V3_FP8_FLOPS_PER_TOKEN
    cluster = load_cluster("2048xh800")
    tokens = 15360 * 4096
    bf16_cfg, _ = load_config(["configs/models/deepseek_v3_671b.yaml"], ["data.seq_len=4096"])
    bf16 = price_compute({k: f * tokens for k, f in flops_by_kernel(bf16_cfg).items()},
                         cluster.devices, cluster)
    assert bf16.peak == cluster.peak_bf16_flops
    fp8 = price_compute({k: f * tokens for k, f in flops_by_kernel(cfg).items()},
                        cluster.devices, cluster)
    assert cluster.peak_bf16_flops < fp8.peak < cluster.peak_fp8_flops
    split = flops_by_kernel(cfg)
    by_hand = tokens / cluster.devices * (
        split["attention"] / (cluster.peak_bf16_flops * cluster.attention_efficiency_bf16)
        + split["gemm_bf16"] / (cluster.peak_bf16_flops * cluster.gemm_efficiency_bf16)
        + (split["gemm_fp8"] + split["routed_fp8"])
        / (cluster.peak_fp8_flops * cluster.gemm_efficiency_fp8))
    assert fp8.seconds == pytest.approx(by_hand, rel=1e-12)
    assert fp8.seconds < bf16.seconds  # FP8 is faster than bf16, by the kernel figures only
    step = step_time(V3_FLOPS_PER_TOKEN * tokens, cluster.devices, cluster, {}, 0.0,
                     efficiency=fp8.efficiency, peak=fp8.peak)
    assert step.compute_s == pytest.approx(fp8.seconds, rel=1e-12)


TOOL = Path(__file__).parents[2] / "tools" / "fp8_hlo.py"
spec = importlib.util.spec_from_file_location("fp8_hlo", TOOL)
fp8_hlo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fp8_hlo)

# the shape of XLA:GPU's optimized HLO for fp8_dot tensorwise (deviceless H200 compile): a
# Triton GEMM fusion whose dot names its f8 parameters without types; the same parameter names
# in another computation are bf16; a cuBLASLt FP8 custom call as a real GPU's autotuner may pick
HLO = """
%gemm_fusion_dot (parameter_0: f8e4m3fn[64,32], parameter_1: f8e4m3fn[32,16]) -> f32[64,16] {
  %parameter_0 = f8e4m3fn[64,32]{1,0} parameter(0)
  %parameter_1 = f8e4m3fn[32,16]{0,1} parameter(1)
  ROOT %dot_general.0 = f32[64,16]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}
}

%plain (parameter_0: bf16[64,32], parameter_1: bf16[32,16]) -> f32[64,16] {
  %parameter_0 = bf16[64,32]{1,0} parameter(0)
  %parameter_1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = f32[64,16]{1,0} dot(%parameter_0, %parameter_1), lhs_contracting_dims={1}
}

ENTRY %main (a: bf16[64,32], b: bf16[32,16]) -> f32[64,16] {
  %a = bf16[64,32]{1,0} parameter(0)
  %q = f8e4m3fn[64,32]{1,0} convert(%a)
  %c = (f32[64,16]{1,0}, s8[0]{0}) custom-call(%q, %q), custom_call_target="__cublas$lt$matmul$f8"
  ROOT %g = bf16[64,16]{1,0} ragged-dot(%a, %b), lhs_contracting_dims={1}
}
"""


def test_fp8_counts_resolves_operand_types_per_computation():
    counts = fp8_hlo.fp8_counts(HLO)
    assert counts["dots"] == 2 and counts["f8_dots"] == 1  # the bf16 one's names collide
    assert counts["ragged_dots"] == 1 and counts["f8_ragged_dots"] == 0
    assert counts["custom_call __cublas$lt$matmul$f8"] == 1
    assert counts["f8_values"] == 3  # the two f8 parameters and the convert


def test_fp8_counts_of_a_cpu_compile_sees_the_quantisation():
    """XLA:CPU upcasts FP8 dots, but the E4M3 converts are there; a bf16 dot has none."""
    x, w = jnp.ones((256, 256), jnp.bfloat16), jnp.ones((256, 128), jnp.bfloat16)
    fp8 = fp8_hlo.fp8_counts(jax.jit(lambda a, b: fp8_dot(a, b, "tensorwise"))
                             .lower(x, w).compile().as_text())
    plain = fp8_hlo.fp8_counts(jax.jit(lambda a, b: a @ b).lower(x, w).compile().as_text())
    assert fp8["f8_values"] > 0 and fp8["dots"] >= 1
    assert plain["f8_values"] == 0 and plain["f8_dots"] == 0 and plain["dots"] == 1
