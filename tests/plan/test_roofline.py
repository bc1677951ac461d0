"""The roofline's figures obey their definitions on hand-computed numbers: compute priced per
kernel class at the device file's published efficiencies (never DeepSeek-V3's end-to-end rate),
the expert all-to-all at its balanced routed bytes, the load imbalance on the routed experts."""

import dataclasses

import numpy as np
import pytest

from maxmoe.cluster import load_cluster
from maxmoe.config import ConfigError
from maxmoe.config_files import load_config
from maxmoe.metrics.flops import flops_by_kernel, flops_per_token
from maxmoe.plan.prerank import ALL_TO_ALL_EXCHANGES, routed_dispatch_bytes
from maxmoe.plan.report import priced_collectives
from maxmoe.plan.roofline import (
    FALLBACK_EFFICIENCY,
    V3_ACHIEVED_FLOPS_PER_GPU,
    V3_FLOPS_PER_TOKEN,
    StepTime,
    adam_checkpoint_bytes,
    checkpoint,
    cost,
    hosts_reached,
    link_bytes,
    parse_tokens,
    price_compute,
    routed_all_to_all_bytes,
    step_time,
    throughput,
)

# round figures so every expectation below is plain arithmetic on the inputs
TOY = dataclasses.replace(load_cluster("16xh100"), peak_bf16_flops=1e12, ici_bandwidth=1e9,
                          dcn_bandwidth=1e8, storage_write_bandwidth=2e9,
                          price_per_device_hour=3.0)


def test_compute_time_is_flops_over_devices_peak_efficiency():
    flops, devices, eff = 6.4e13, 16, 0.5
    t = step_time(flops, devices, TOY, {}, 0.0, efficiency=eff)
    assert t.compute_s == pytest.approx(flops / (devices * TOY.peak_bf16_flops * eff))  # 8 s
    assert (t.ici_s, t.dcn_s, t.exposed_comm_s, t.bubble_s) == (0, 0, 0, 0)
    assert t.step_s == t.compute_s


def test_comm_time_is_bytes_over_each_links_bandwidth():
    ici_bytes, dcn_bytes = 3e9, 2e8
    sent = {"fsdp": {"all-gather": {"ici": ici_bytes / 2, "dcn": 0.0},
                     "reduce-scatter": {"ici": ici_bytes / 2}},
            "data": {"all-reduce": {"dcn": dcn_bytes}}}
    assert link_bytes(sent) == {"ici": ici_bytes, "dcn": dcn_bytes}
    t = step_time(1.6e13, 16, TOY, sent, 0.0, efficiency=1.0, overlap=0.0)
    assert t.ici_s == pytest.approx(ici_bytes / TOY.ici_bandwidth)  # 3 s
    assert t.dcn_s == pytest.approx(dcn_bytes / TOY.dcn_bandwidth)  # 2 s
    assert t.exposed_comm_s == pytest.approx(t.ici_s + t.dcn_s)
    assert t.step_s == pytest.approx(t.compute_s + t.ici_s + t.dcn_s)
    doubled = {"x": {"all-to-all": {"ici": 2 * ici_bytes}}}
    assert step_time(1.6e13, 16, TOY, doubled, 0.0).ici_s == pytest.approx(2 * t.ici_s)
    with pytest.raises(ValueError, match="'nvlink'"):
        link_bytes({"x": {"all-to-all": {"nvlink": 1.0}}})


def test_overlap_hides_a_fraction_of_comm_but_never_more_than_compute():
    sent = {"fsdp": {"all-gather": {"ici": 4e9}}}  # 4 s on TOY
    compute = 1.6e13 / (16 * TOY.peak_bf16_flops)  # 1 s at efficiency 1
    half = step_time(1.6e13, 16, TOY, sent, 0.0, efficiency=1.0, overlap=0.5)
    assert half.exposed_comm_s == pytest.approx(4.0 - min(0.5 * 4.0, compute))  # 3 s
    full = step_time(1.6e13 * 8, 16, TOY, sent, 0.0, efficiency=1.0, overlap=1.0)
    assert full.exposed_comm_s == pytest.approx(0.0) and full.step_s == full.compute_s


def test_bubble_is_the_idle_share_of_the_whole_step():
    """A stage idles f = (P-1) / (M+P-1) of the pipelined step (1F1B) and computes the rest, so
    step = compute / (1 - f): at P = M = 16 the bubble adds 15/16 = 0.94x compute (f x compute
    would be 0.48x)."""
    stages = microbatches = 16
    idle = (stages - 1) / (microbatches + stages - 1)
    t = step_time(6.4e13, 16, TOY, {}, idle, efficiency=0.5)
    assert t.bubble_s == pytest.approx(15 / 16 * t.compute_s)
    assert t.step_s == pytest.approx(t.compute_s / (1 - idle))
    assert (t.step_s - t.bubble_s) / t.step_s == pytest.approx(1 - idle)  # busy share
    with pytest.raises(ValueError, match="idle_fraction"):
        step_time(6.4e13, 16, TOY, {}, 1.0)


def test_the_bubble_idles_beside_the_pipelined_compute_alone():
    """What runs outside the pipeline (embedding, dense prefix, LM head, MTP:
    metrics.flops.pipelined_share is the rest) idles no stage: the bubble is f / (1 - f) of the
    pipelined share of the compute, the rest of the step is unchanged."""
    idle = 15 / 31
    whole = step_time(6.4e13, 16, TOY, {}, idle, efficiency=0.5)
    part = step_time(6.4e13, 16, TOY, {}, idle, efficiency=0.5, pipelined=0.9)
    assert part.bubble_s == pytest.approx(0.9 * 15 / 16 * part.compute_s)
    assert part.compute_s == whole.compute_s
    assert whole.step_s - part.step_s == pytest.approx(0.1 * whole.bubble_s)
    with pytest.raises(ValueError, match="pipelined"):
        step_time(6.4e13, 16, TOY, {}, idle, pipelined=1.5)


def test_throughput_and_mfu_definitions():
    step_s, tokens, flops, devices, peak = 4.0, 1_000_000, 3.2e13, 16, 1e12
    out = throughput(step_s, tokens, flops, devices, peak)
    assert out.tokens_per_s == pytest.approx(tokens / step_s)
    assert out.mfu == pytest.approx(flops / (devices * peak * step_s))  # 0.5
    assert out.tokens_per_day == pytest.approx(tokens / step_s * 86400)
    as_step = StepTime(3.0, 0.5, 0.5, 1.0, 0.0, step_s)
    assert throughput(as_step, tokens, flops, devices, peak) == out


def test_cost_per_trillion_tokens_and_totals():
    step_s, tokens_per_step, devices = 10.0, 1e6, 16
    per_t = step_s * devices / 3600 * (1e12 / tokens_per_step)  # 44,444.4 device-hours
    c = cost(step_s, tokens_per_step, devices, TOY, tokens=2.5e6)
    assert c.device_hours_per_trillion_tokens == pytest.approx(per_t)
    assert c.dollars_per_trillion_tokens == pytest.approx(per_t * 3.0)
    assert c.steps == 3  # 2.5 steps of tokens round up to whole steps
    assert c.device_hours == pytest.approx(3 * step_s * devices / 3600)
    assert c.days == pytest.approx(3 * step_s / 86400)
    assert c.dollars == pytest.approx(c.device_hours * 3.0)
    by_steps = cost(step_s, tokens_per_step, devices, TOY, steps=3)
    assert (by_steps.device_hours, by_steps.tokens) == (c.device_hours, 3e6)
    bare = cost(step_s, tokens_per_step, devices, TOY)
    assert bare.device_hours is None
    assert bare.device_hours_per_trillion_tokens == c.device_hours_per_trillion_tokens
    with pytest.raises(ValueError):
        cost(step_s, tokens_per_step, devices, TOY, tokens=1e6, steps=1)


@pytest.mark.parametrize("text, value", [
    ("14.8T", 14.8e12), ("500B", 5e11), ("2G", 2e9), ("300m", 3e8), ("4K", 4000),
    ("1000000", 1e6), ("1e12", 1e12), (" 7 T ", 7e12),
])
def test_parse_tokens(text, value):
    assert parse_tokens(text) == value


@pytest.mark.parametrize("text", ["", "abc", "14.8X", "-5T", "0", "1.2.3T", "T", "nan", "5TB"])
def test_parse_tokens_rejects_junk_naming_the_flag(text):
    with pytest.raises(ConfigError, match="--tokens") as e:
        parse_tokens(text)
    assert repr(text) in str(e.value) and "\n" not in str(e.value)


def test_checkpoint_size_and_parallel_save_time():
    size = adam_checkpoint_bytes(671e9)
    assert size == pytest.approx(671e9 * (4 + 4 + 4))  # f32 params + two f32 moments
    assert 8e12 <= size <= 8.1e12  # "~8 TB"
    got, seconds = checkpoint(size, TOY)
    assert got == size
    assert seconds == pytest.approx(size / (TOY.hosts * TOY.storage_write_bandwidth))
    assert TOY.hosts == 2


def test_deepseek_v3_rate_is_a_comparison_figure_not_the_pricing():
    """V3's achieved rate (2.664M H800-hours for 14.8T tokens, arXiv 2412.19437 Table 1) is
    4.02e14 FLOP/s per GPU on the model's FLOP count; the planner's price of V3's compute at seq
    4096 on 2048xh800 (bf16, no remat) comes from the kernel figures instead, so it differs."""
    cfg, _ = load_config(["configs/models/deepseek_v3_671b.yaml"], ["data.seq_len=4096"])
    assert flops_per_token(cfg) == V3_FLOPS_PER_TOKEN  # the count the comparison uses
    assert V3_ACHIEVED_FLOPS_PER_GPU == pytest.approx(14.8e12 * V3_FLOPS_PER_TOKEN
                                                      / (2.664e6 * 3600))
    cluster = load_cluster("2048xh800")
    tokens = 15360 * 4096
    flops = {k: f * tokens for k, f in flops_by_kernel(cfg).items()}
    price = price_compute(flops, cluster.devices, cluster)
    rate = V3_FLOPS_PER_TOKEN * tokens / (cluster.devices * price.seconds)
    by_hand = V3_FLOPS_PER_TOKEN / (
        flops_by_kernel(cfg)["attention"] / (989e12 * 0.478)
        + (V3_FLOPS_PER_TOKEN - flops_by_kernel(cfg)["attention"]) / (989e12 * 0.803))
    assert rate == pytest.approx(by_hand, rel=1e-12)
    assert rate > 1.5 * V3_ACHIEVED_FLOPS_PER_GPU  # kernel rates, no communication in them


H = dataclasses.replace(TOY, peak_fp8_flops=2e12, gemm_efficiency_bf16=0.8,
                        gemm_efficiency_bf16_source="bf16 gemm paper",
                        gemm_efficiency_fp8=0.6, gemm_efficiency_fp8_source="fp8 gemm readme",
                        attention_efficiency_bf16=0.5, attention_efficiency_bf16_source="fa3")


def test_price_compute_prices_each_class_at_its_peak_and_efficiency():
    """bf16 GEMMs at 1e12 x 0.8, FP8 GEMMs at 2e12 x 0.6, attention at 1e12 x 0.5, the routed
    experts imbalance times longer, everything recompute times; 16 devices."""
    flops = {"attention": 8e12, "gemm_bf16": 12.8e12, "gemm_fp8": 9.6e12, "routed_bf16": 0.0,
             "routed_fp8": 19.2e12}
    p = price_compute(flops, 16, H, imbalance=1.25, recompute=4 / 3)
    by_hand = 4 / 3 * (8e12 / 0.5e12 + 12.8e12 / 0.8e12 + (9.6e12 + 1.25 * 19.2e12) / 1.2e12) / 16
    assert p.seconds == pytest.approx(by_hand, rel=1e-12)  # 4/3 x (16 + 16 + 28) / 16 = 5 s
    total, fp8 = sum(flops.values()), 9.6e12 + 19.2e12
    assert p.peak == pytest.approx(total / ((total - fp8) / 1e12 + fp8 / 2e12), rel=1e-12)
    t = step_time(total, 16, H, {}, 0.0, efficiency=p.efficiency, peak=p.peak)
    assert t.compute_s == pytest.approx(p.seconds, rel=1e-12)
    assert "fa3" in p.source and "fp8 gemm readme" in p.source and "bf16 gemm paper" in p.source
    assert "routed_bf16" not in p.source  # a class with no FLOPs names no figure
    slower = price_compute(flops, 16, H, imbalance=1.5, recompute=4 / 3)
    assert slower.seconds - p.seconds == pytest.approx(4 / 3 * 0.25 * 19.2e12 / 1.2e12 / 16)
    with pytest.raises(ValueError, match="imbalance"):
        price_compute(flops, 16, H, imbalance=0.9)


def test_a_kind_without_figures_gets_the_labelled_fallback():
    cpu = load_cluster("8xcpu")
    assert cpu.gemm_efficiency_bf16 is None
    p = price_compute({"gemm_bf16": 1e12, "attention": 1e12}, 8, cpu)
    assert p.seconds == pytest.approx(2e12 / (8 * cpu.peak_bf16_flops * FALLBACK_EFFICIENCY))
    assert p.source.count("fallback") == 2


def test_routed_all_to_all_bytes_by_hand():
    """671B layout (configs/experiments/deepseek_v3_2048xh800_flat.yaml): 16,777,216 tokens a step
    over 2048 devices (the batch axes fsdp 32 x expert 64) = 8192 per device, top-8 of hidden
    7168 in bf16 (2 bytes), 58 MoE layers + 1 MTP depth, expert 64 over 8 hosts (8 shards per
    host), 6 exchanges (dispatch, combine, both again and two gradients in the backward): of a
    device's assignments 7/64 go to its host's other shards, 56/64 across hosts."""
    per_layer = 6 * 8192 * 8 * 7168 * 2
    want = {"ici": per_layer * 59 * 7 / 64, "dcn": per_layer * 59 * 56 / 64}
    got = routed_all_to_all_bytes(8192, 8, 7168, 2, 64, 8, 6, 59)
    assert got == pytest.approx(want, rel=1e-12)
    assert got["dcn"] == pytest.approx(291.0e9, rel=1e-3)  # GB a device sends across hosts
    cfg, _ = load_config(["configs/models/deepseek_v3_671b.yaml",
                          "configs/experiments/deepseek_v3_2048xh800_flat.yaml"])
    sizes = {a: getattr(cfg.mesh, a) for a in ("data", "fsdp", "pipeline", "expert", "tensor")}
    dcn = {a: getattr(cfg.mesh, f"dcn_{a}") for a in sizes}
    assert ALL_TO_ALL_EXCHANGES == 6
    assert routed_dispatch_bytes(cfg, sizes, dcn) == pytest.approx(want, rel=1e-12)
    # FP8 dispatch: 2 of the 6 exchanges at 1 + 4/128 bytes an element, 4 at bf16's 2
    fp8, _ = load_config(["configs/models/deepseek_v3_671b.yaml",
                          "configs/experiments/deepseek_v3_2048xh800_flat.yaml"],
                         ["precision.fp8=blockwise"])
    ratio = (4 * 2 + 2 * (1 + 4 / 128)) / (6 * 2)
    assert routed_dispatch_bytes(fp8, sizes, dcn) == pytest.approx(
        {k: v * ratio for k, v in want.items()}, rel=1e-12)
    assert routed_all_to_all_bytes(100, 2, 10, 4, 1, 1, 6, 3) == {"ici": 0.0, "dcn": 0.0}
    with pytest.raises(ValueError, match="divide"):
        routed_all_to_all_bytes(100, 2, 10, 4, 8, 3, 6, 3)


def test_the_step_is_priced_with_routed_bytes_times_the_imbalance():
    compiled = {"expert": {"all-to-all": {"ici": 9e9, "dcn": 90e9},
                           "all-gather": {"ici": 1e9, "dcn": 2e9}},
                "fsdp": {"all-to-all": {"ici": 0.0, "dcn": 5e9}}}
    routed = {"ici": 3e9, "dcn": 30e9}
    priced = priced_collectives(compiled, routed, 1.2)
    assert priced["expert"]["all-to-all"] == pytest.approx({"ici": 3.6e9, "dcn": 36e9})
    assert priced["expert"]["all-gather"] == compiled["expert"]["all-gather"]
    assert priced["fsdp"] == compiled["fsdp"]  # not the expert dispatch
    assert compiled["expert"]["all-to-all"]["dcn"] == 90e9  # the compiled figure is kept
    assert priced_collectives(compiled, None, 1.2) is compiled  # other transports: as compiled
    t = step_time(1.6e13, 16, TOY, priced, 0.0, efficiency=1.0, overlap=0.0)
    assert t.dcn_s == pytest.approx((36e9 + 2e9 + 5e9) / TOY.dcn_bandwidth)


@pytest.mark.parametrize("experts, k, groups, per_token, hosts", [
    (256, 8, 8, 4, 8),  # DeepSeek-V3 on 8 hosts: one group a host
    (32, 8, 8, 4, 2),  # tiny DeepSeek, 4 groups a host
    (64, 6, 4, 2, 8),  # a group spans 2 hosts
    (128, 8, 1, 1, 4),  # no groups
])
def test_hosts_reached_matches_simulated_group_limited_routing(experts, k, groups, per_token,
                                                                hosts):
    """roofline.hosts_reached against 100,000 tokens routed at random the way balanced
    group-limited routing does (top groups uniform, then experts uniform among theirs), hosts
    holding contiguous experts: the mean of distinct hosts a token's experts lie on, within
    0.01 absolute (the mean's standard error is under 0.003)."""
    rng = np.random.default_rng(0)
    n, per_group = 100_000, experts // groups
    chosen = np.argsort(rng.random((n, groups)), axis=1)[:, :per_token]  # the token's groups
    pool = (chosen[:, :, None] * per_group + np.arange(per_group)).reshape(n, -1)
    pick = np.take_along_axis(pool, np.argsort(rng.random(pool.shape), axis=1)[:, :k], axis=1)
    host = pick // (experts // hosts)
    reached = (host[:, :, None] == np.arange(hosts)).any(axis=1).sum(axis=1)
    assert hosts_reached(experts, k, groups, per_token, hosts) == pytest.approx(
        reached.mean(), abs=0.01)


def test_two_level_routed_bytes_by_hand():
    """The 671B layout under moe.transport=two_level (configs/experiments/deepseek_v3_2048xh800_flat
    .yaml: 8192 tokens a device, top-8 of 256 experts in 4 of 8 groups, expert 64 over 8 hosts,
    bf16, remat full): hop 1 sends each token to the hosts_reached(256, 8, 8, 4, 8) hosts its
    experts lie on, less its own (7/8 of them), 5 times (prerank.hop1_exchanges) across hosts;
    hop 2 is all_to_all's 6 exchanges of T K rows over the host's 8 shards, 7/8 of them to
    another device inside it. With precision.fp8, 2 of hop 1's 5 and of hop 2's 6 travel at
    1 + 4/128 bytes an element."""
    files = ["configs/models/deepseek_v3_671b.yaml",
             "configs/experiments/deepseek_v3_2048xh800_flat.yaml"]
    cfg, _ = load_config(files, ["moe.transport=two_level"])
    sizes = {a: getattr(cfg.mesh, a) for a in ("data", "fsdp", "pipeline", "expert", "tensor")}
    dcn = {a: getattr(cfg.mesh, f"dcn_{a}") for a in sizes}
    reached = hosts_reached(256, 8, 8, 4, 8)
    assert 3.6 < reached < 3.7  # 8 x (1 - P(a host holds none of the token's experts))
    across = 5 * 8192 * reached * 7 / 8 * 7168 * 2 * 59
    inside = 6 * 8192 * 8 * 7168 * 2 * 59 * 7 / 8
    assert routed_dispatch_bytes(cfg, sizes, dcn) == pytest.approx(
        {"ici": inside, "dcn": across}, rel=1e-12)
    assert across == pytest.approx(110.0e9, rel=1e-3)  # GB across hosts: all_to_all's is 291
    fp8, _ = load_config(files, ["moe.transport=two_level", "precision.fp8=blockwise"])
    wire = 1 + 4 / 128
    assert routed_dispatch_bytes(fp8, sizes, dcn) == pytest.approx(
        {"ici": inside * (4 * 2 + 2 * wire) / 12, "dcn": across * (3 * 2 + 2 * wire) / 10},
        rel=1e-12)
