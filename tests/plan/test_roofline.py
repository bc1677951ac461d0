"""The roofline's figures obey their definitions on hand-computed numbers, and the compute
efficiency reproduces DeepSeek-V3's published 180K H800 GPU-hours per trillion tokens."""

import dataclasses

import pytest

from maxmoe.cluster import load_cluster
from maxmoe.config import ConfigError
from maxmoe.config_files import load_config
from maxmoe.metrics.flops import flops_per_token
from maxmoe.plan.roofline import (
    COMPUTE_EFFICIENCY,
    V3_FLOPS_PER_TOKEN,
    StepTime,
    adam_checkpoint_bytes,
    checkpoint,
    cost,
    link_bytes,
    parse_tokens,
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


def test_efficiency_reproduces_deepseek_v3_gpu_hours_per_trillion_tokens():
    """The calibration, round trip: V3 at seq 4096 on 2048xh800 with no communication costs
    180K H800 GPU-hours per trillion tokens (arXiv 2412.19437: 2.664M hours / 14.8T tokens)."""
    cfg, _ = load_config(["configs/models/deepseek_v3_671b.yaml"], ["data.seq_len=4096"])
    assert flops_per_token(cfg) == V3_FLOPS_PER_TOKEN  # the count the derivation used
    cluster = load_cluster("2048xh800")
    tokens_per_step = 15360 * 4096  # V3's final batch of 15360 sequences
    step = step_time(flops_per_token(cfg) * tokens_per_step, cluster.devices, cluster, {}, 0.0,
                     efficiency=COMPUTE_EFFICIENCY)
    run = cost(step.step_s, tokens_per_step, cluster.devices, cluster, tokens=14.8e12)
    assert run.device_hours_per_trillion_tokens == pytest.approx(2.664e6 / 14.8, rel=0.01)
    assert run.device_hours == pytest.approx(2.664e6, rel=0.01)
    assert run.dollars == pytest.approx(5.328e6, rel=0.01)  # V3 report Table 1, at $2/GPU-hour
