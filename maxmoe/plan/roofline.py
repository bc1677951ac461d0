"""Step time, throughput, cost and checkpoint figures of a plan, from plain numbers.

Pure arithmetic, no JAX: the compile probe supplies model FLOPs and collective bytes per step,
a `Cluster` supplies peaks, bandwidths and prices, and these functions turn them into seconds,
tokens/s, MFU, device-hours and dollars. Every assumption is a named constant below with its
reasoning; the compute efficiency is calibrated on DeepSeek-V3's published training cost.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation

from maxmoe.cluster import Cluster, load_device_kind
from maxmoe.config import ConfigError

# ---------------------------------------------------------------- the compute efficiency
# DeepSeek-V3 (arXiv 2412.19437): pre-training on 14.8T tokens took 2.664M H800 GPU-hours
# (Table 1; "180K H800 GPU hours" per trillion tokens, sec. 1), with FP8 GEMMs (sec. 3.3).
V3_PRETRAIN_TOKENS = 14.8e12
V3_PRETRAIN_GPU_HOURS = 2.664e6
# maxmoe.metrics.flops.flops_per_token on configs/models/deepseek_v3_671b.yaml with
# data.seq_len=4096 (V3's pre-training length): 6 x (36.63B active + 1.61B MTP-depth params)
# + 31.2 GFLOPs of causal attention = 260,647,919,616 FLOPs per token (2.606e11);
# tests/plan/test_roofline.py recomputes it, so a change of the count shows up there.
V3_FLOPS_PER_TOKEN = 260_647_919_616
# V3's GPU's dense peaks, from its device file (the one source of device figures)
H800_PEAK_BF16 = load_device_kind("h800")[0]["peak_bf16_flops"]
H800_PEAK_FP8 = load_device_kind("h800")[0]["peak_fp8_flops"]
# 14.8e12 tok x 2.606e11 FLOP/tok = 3.858e24 FLOPs over 2.664e6 x 3600 = 9.590e9 GPU-seconds
# -> 4.022e14 FLOP/s achieved per GPU = 40.7% of the bf16 dense peak (20.3% of the fp8 peak).
# It is end to end: whatever communication and pipeline bubble DualPipe did not hide is in it,
# so adding exposed communication on top (step_time) is slightly pessimistic. It is relative to
# the bf16 peak although V3 ran FP8 GEMMs, so for a bf16 run it is optimistic. For comparison,
# Llama 3 405B (bf16, dense) reached 380-430 TFLOP/s per H100, 38-43% (arXiv 2407.21783).
V3_ACHIEVED_FLOPS_PER_GPU = (V3_PRETRAIN_TOKENS * V3_FLOPS_PER_TOKEN
                             / (V3_PRETRAIN_GPU_HOURS * 3600))
COMPUTE_EFFICIENCY = V3_ACHIEVED_FLOPS_PER_GPU / H800_PEAK_BF16  # 0.4067
COMPUTE_EFFICIENCY_OF_FP8_PEAK = V3_ACHIEVED_FLOPS_PER_GPU / H800_PEAK_FP8  # 0.2033
# A plan with precision.fp8 on counts its compute per matmul class (metrics.flops
# MFU_CONVENTION): the FP8 class's FLOPs at the fp8 peak, the rest at the bf16 one, i.e. at
# effective_peak. V3 under that convention: 6 x fp8_params_per_token with precision.fp8 on =
# 217,049,726,976 of its 260.6 GFLOPs per token (83.3%) are FP8 (tests/plan/test_roofline.py
# recomputes it) -> an effective H800 peak of 1.695e15 and 4.022e14 achieved = 23.7% of it.
# FP8 plans run at that efficiency of their effective peak, so V3's own plan keeps V3's
# measured rate: no FP8 speed-up beyond what V3 reached is assumed.
V3_FP8_FLOPS_PER_TOKEN = 217_049_726_976


def effective_peak(model_flops: float, fp8_flops: float, bf16_peak: float,
                   fp8_peak: float) -> float:
    """The one per-device peak at which `model_flops` take as long as their bf16 part at
    `bf16_peak` plus their `fp8_flops` part at `fp8_peak`; exactly bf16_peak when fp8_flops
    is 0."""
    if not fp8_flops:
        return bf16_peak
    return model_flops / ((model_flops - fp8_flops) / bf16_peak + fp8_flops / fp8_peak)


COMPUTE_EFFICIENCY_FP8 = V3_ACHIEVED_FLOPS_PER_GPU / effective_peak(
    V3_FLOPS_PER_TOKEN, V3_FP8_FLOPS_PER_TOKEN, H800_PEAK_BF16, H800_PEAK_FP8)  # 0.2373


def compute_peak(model_flops: float, fp8_flops: float, cluster: Cluster) -> tuple[float, float]:
    """(per-device peak, efficiency) a step's compute is planned at: the bf16 peak and
    COMPUTE_EFFICIENCY when none of its FLOPs are FP8 (precision.fp8 none), else the cluster's
    effective_peak and COMPUTE_EFFICIENCY_FP8."""
    if not fp8_flops:
        return cluster.peak_bf16_flops, COMPUTE_EFFICIENCY
    return (effective_peak(model_flops, fp8_flops, cluster.peak_bf16_flops,
                           cluster.peak_fp8_flops), COMPUTE_EFFICIENCY_FP8)

# ---------------------------------------------------------------- the overlap assumption
# Fraction of the communication time hidden under compute (never more than the compute time).
# XLA's latency-hiding scheduler issues FSDP weight all-gathers and gradient reduce-scatters
# asynchronously beside the neighbouring layers' compute, so those hide well; the MoE
# dispatch/combine all-to-alls sit on the critical path between router and experts and hide only
# where micro-batches are interleaved (DeepSeek's DualPipe), which maxmoe does not do. Half is an
# assumption between those two until a GPU profile measures it (docs/performance.md). XLA:GPU
# plans read the exposed time from the compiled schedule instead (plan/overlap.py).
COMM_OVERLAP = 0.5

LINKS = ("ici", "dcn")
# params (f32, 4 B) + Adam's two moments (f32, 4 B each; optimizer.moment_dtype default) per param
CHECKPOINT_BYTES_PER_PARAM = 12


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one train step: step_s = compute_s + exposed_comm_s + bubble_s."""

    compute_s: float  # model FLOPs at efficiency x the dense bf16 (or effective) peak
    ici_s: float  # bytes one device sends inside its host / ici_bandwidth
    dcn_s: float  # bytes one device sends across hosts / dcn_bandwidth
    exposed_comm_s: float  # ici_s + dcn_s less what overlaps compute
    bubble_s: float  # pipeline bubble: idle / (1 - idle) x compute_s (step_time)
    step_s: float


@dataclasses.dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    mfu: float  # model FLOPs / (devices x bf16 (or effective) peak x step_s)
    tokens_per_day: float


@dataclasses.dataclass(frozen=True)
class Cost:
    """What a run of `steps` steps (`tokens` tokens) costs; totals are None when neither was
    given, the per-trillion figures never are."""

    steps: int | None
    tokens: float | None
    device_hours: float | None
    days: float | None  # wall-clock
    dollars: float | None
    device_hours_per_trillion_tokens: float
    dollars_per_trillion_tokens: float


def link_bytes(collective_bytes: Mapping[str, Mapping[str, Mapping[str, float]]]
               ) -> dict[str, float]:
    """{"ici": total, "dcn": total}: the bytes one device sends per step over each link class,
    summed over `collective_bytes` = {axis_label: {kind: {"ici": bytes, "dcn": bytes}}}."""
    totals = dict.fromkeys(LINKS, 0.0)
    for axis, kinds in collective_bytes.items():
        for kind, links in kinds.items():
            for link, n in links.items():
                if link not in totals:
                    raise ValueError(f"collective_bytes[{axis!r}][{kind!r}]: link {link!r} is "
                                     f"not one of {LINKS}")
                totals[link] += float(n)
    return totals


def step_time(model_flops_per_step: float, devices: int, cluster: Cluster,
              collective_bytes: Mapping[str, Mapping[str, Mapping[str, float]]],
              idle_fraction: float, *, efficiency: float = COMPUTE_EFFICIENCY,
              overlap: float = COMM_OVERLAP, peak: float | None = None,
              exposed_comm_s: float | None = None) -> StepTime:
    """Roofline step time of `devices` devices of `cluster` for a step of
    `model_flops_per_step` FLOPs (all devices together): compute at `efficiency` x `peak`
    (default the dense bf16 peak; compute_peak gives both for an FP8 step); each link class's
    bytes (link_bytes) over its bandwidth, the two classes in series; `overlap` of that hidden
    under compute. `idle_fraction` f is the share of the pipelined step a stage idles
    (model.spec.pipeline_idle: (P-1) / (V M + P-1) with padding): busy for the compute, idle
    for f of the total, so the bubble adds f / (1 - f) x compute (P = M = 16: 0.94x, not the
    0.48x that f x compute gave). `exposed_comm_s`, where given (read from XLA:GPU's compiled
    schedule, plan/overlap.py), is the exposed communication instead of `overlap`'s."""
    if devices < 1 or not 0 < efficiency <= 1 or not 0 <= overlap <= 1 \
            or not 0 <= idle_fraction < 1:
        raise ValueError(f"step_time: devices={devices}, efficiency={efficiency}, "
                         f"overlap={overlap}, idle_fraction={idle_fraction} out of range")
    peak = cluster.peak_bf16_flops if peak is None else peak
    compute = model_flops_per_step / (devices * peak * efficiency)
    sent = link_bytes(collective_bytes)
    ici, dcn = sent["ici"] / cluster.ici_bandwidth, sent["dcn"] / cluster.dcn_bandwidth
    exposed = (ici + dcn) - min(overlap * (ici + dcn), compute) if exposed_comm_s is None \
        else exposed_comm_s
    bubble = idle_fraction / (1 - idle_fraction) * compute
    return StepTime(compute_s=compute, ici_s=ici, dcn_s=dcn, exposed_comm_s=exposed,
                    bubble_s=bubble, step_s=compute + exposed + bubble)


def throughput(step: StepTime | float, tokens_per_step: float, model_flops_per_step: float,
               devices: int, peak: float) -> Throughput:
    """Tokens/s, MFU and tokens/day of a step taking `step` (a StepTime or seconds) on
    `devices` devices of `peak` FLOP/s each (the dense bf16 peak, as MFU is quoted; an FP8
    step's effective_peak, which makes it metrics.flops.MFU_CONVENTION's MFU)."""
    seconds = step.step_s if isinstance(step, StepTime) else float(step)
    tokens_per_s = tokens_per_step / seconds
    return Throughput(tokens_per_s=tokens_per_s,
                      mfu=model_flops_per_step / (devices * peak * seconds),
                      tokens_per_day=tokens_per_s * 86400)


def cost(step_s: float, tokens_per_step: float, devices: int, cluster: Cluster, *,
         tokens: float | None = None, steps: int | None = None) -> Cost:
    """Device-hours, wall-clock days and dollars (at cluster.price_per_device_hour) of training
    `tokens` tokens (rounded up to whole steps) or `steps` steps at `step_s` seconds a step;
    per-trillion-token figures always."""
    if tokens is not None and steps is not None:
        raise ValueError("cost: pass tokens or steps, not both")
    per_trillion = step_s * devices / 3600 / tokens_per_step * 1e12
    price = cluster.price_per_device_hour
    if tokens is not None:
        steps = math.ceil(tokens / tokens_per_step)
    if steps is None:
        return Cost(None, None, None, None, None, per_trillion, per_trillion * price)
    hours = steps * step_s * devices / 3600
    return Cost(steps=steps, tokens=tokens if tokens is not None else steps * tokens_per_step,
                device_hours=hours, days=steps * step_s / 86400, dollars=hours * price,
                device_hours_per_trillion_tokens=per_trillion,
                dollars_per_trillion_tokens=per_trillion * price)


_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_TOKENS = re.compile(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*")


def parse_tokens(text: str) -> float:
    """`--tokens` as a number: "14.8T" -> 14.8e12, "500B", "2G", "300M", "4K", "1e12",
    "1000000". Raises ConfigError on anything else or a count that is not positive."""
    match = _TOKENS.fullmatch(str(text))
    try:
        value = Decimal(match.group(1)) * _SUFFIX[match.group(2).upper()] if match else None
    except InvalidOperation:
        value = None
    if value is None or value <= 0:
        raise ConfigError(f"--tokens {text!r}: not a positive token count; write a number with "
                          "an optional K, M, B/G or T suffix, e.g. 14.8T")
    return float(value)


def adam_checkpoint_bytes(num_params: float) -> float:
    """Bytes of a checkpoint of `num_params` parameters with Adam's state
    (CHECKPOINT_BYTES_PER_PARAM each): 671B params -> 8.05e12 bytes."""
    return num_params * CHECKPOINT_BYTES_PER_PARAM


def checkpoint(state_bytes_total: float, cluster: Cluster) -> tuple[float, float]:
    """(size in bytes, seconds to save) of a checkpoint of `state_bytes_total` bytes written
    by all of the cluster's hosts in parallel, each at storage_write_bandwidth."""
    return state_bytes_total, state_bytes_total / (cluster.hosts * cluster.storage_write_bandwidth)
