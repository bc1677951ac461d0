"""Step time, throughput, cost and checkpoint figures of a plan, from plain numbers.

Pure arithmetic, no JAX: the compile probe supplies model FLOPs and collective bytes per step,
a `Cluster` supplies peaks, bandwidths and prices, and these functions turn them into seconds,
tokens/s, MFU, device-hours and dollars. Every assumption is a named constant below with its
reasoning; compute is priced per kernel class at the device file's published kernel-level
efficiencies (price_compute), DeepSeek-V3's end-to-end rate kept only as a comparison figure.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation

from maxmoe.cluster import Cluster
from maxmoe.config import ConfigError

# ---------------------------------------------------------------- DeepSeek-V3, for comparison
# DeepSeek-V3 (arXiv 2412.19437): pre-training on 14.8T tokens took 2.664M H800 GPU-hours
# (Table 1; "180K H800 GPU hours" per trillion tokens, sec. 1), with FP8 GEMMs (sec. 3.3). Its
# achieved rate is a comparison figure only: pricing a plan with it would make any comparison
# with DeepSeek circular (issue 41), so compute is priced per kernel class (price_compute).
V3_PRETRAIN_TOKENS = 14.8e12
V3_PRETRAIN_GPU_HOURS = 2.664e6
# maxmoe.metrics.flops.flops_per_token on configs/models/deepseek_v3_671b.yaml with
# data.seq_len=4096 (V3's pre-training length): 6 x (36.63B active + 1.61B MTP-depth params)
# + 31.2 GFLOPs of causal attention = 260,647,919,616 FLOPs per token (2.606e11);
# tests/plan/test_roofline.py recomputes it, so a change of the count shows up there.
V3_FLOPS_PER_TOKEN = 260_647_919_616
# of which 6 x fp8_params_per_token with precision.fp8 on: 217,049,726,976 (83.3%) are FP8
V3_FP8_FLOPS_PER_TOKEN = 217_049_726_976
# 14.8e12 tok x 2.606e11 FLOP/tok / (2.664e6 x 3600 GPU-s) = 4.022e14 FLOP/s per H800, end to
# end (40.7% of the bf16 dense peak, 20.3% of the fp8 one)
V3_ACHIEVED_FLOPS_PER_GPU = (V3_PRETRAIN_TOKENS * V3_FLOPS_PER_TOKEN
                             / (V3_PRETRAIN_GPU_HOURS * 3600))

# ---------------------------------------------------------------- kernel-level compute pricing
# Each class of metrics.flops.flops_by_kernel runs at its peak x its kernel-level efficiency,
# from the device's configs/devices/ file (published GEMM and attention figures, with sources).
# class -> (Cluster efficiency field, the peak it is a fraction of)
KERNEL_PRICING = {"attention": ("attention_efficiency_bf16", "peak_bf16_flops"),
                  "gemm_bf16": ("gemm_efficiency_bf16", "peak_bf16_flops"),
                  "routed_bf16": ("gemm_efficiency_bf16", "peak_bf16_flops"),
                  "gemm_fp8": ("gemm_efficiency_fp8", "peak_fp8_flops"),
                  "routed_fp8": ("gemm_efficiency_fp8", "peak_fp8_flops")}
# A kind whose file has no figure for a class (a100 FP8 and attention, b200 attention, cpu) is
# priced at this fallback, labelled in the plan: below every published figure in configs/devices
# (the lowest is FlashAttention-3's 0.478 per model FLOP on H100), so a kind without figures is
# never priced faster than one with them. An assumption, not a measurement.
FALLBACK_EFFICIENCY = 0.45
FALLBACK_SOURCE = (f"fallback {FALLBACK_EFFICIENCY} (roofline.FALLBACK_EFFICIENCY: no published "
                   "figure in the device file)")
# Expert-load imbalance: the busiest expert shard's tokens over the mean sets the pace of the
# dispatch and the routed-expert GEMMs (every shard waits for it). An assumption, not measured:
# maxmoe has no converged run at scale; its only logged figures are short tiny CPU runs
# (metrics.jsonl load_max_mean_ratio_max 1.49-1.66 per expert after 150 steps of
# configs/tiny.yaml, bias balancing off), which say nothing of a trained, balanced router over
# shards of many experts. Override with `maxmoe plan --load-imbalance`; 1 where ep is 1.
DEFAULT_LOAD_IMBALANCE = 1.10
LOAD_IMBALANCE_SOURCE = ("assumed (roofline.DEFAULT_LOAD_IMBALANCE): busiest expert shard over "
                         "the mean; not measured")


def effective_peak(model_flops: float, fp8_flops: float, bf16_peak: float,
                   fp8_peak: float) -> float:
    """The one per-device peak at which `model_flops` take as long as their bf16 part at
    `bf16_peak` plus their `fp8_flops` part at `fp8_peak`; exactly bf16_peak when fp8_flops
    is 0. MFU is quoted against it (metrics.flops.MFU_CONVENTION)."""
    if not fp8_flops:
        return bf16_peak
    return model_flops / ((model_flops - fp8_flops) / bf16_peak + fp8_flops / fp8_peak)


def kernel_efficiency(cluster: Cluster, kernel_class: str) -> tuple[float, str]:
    """(efficiency, its source) of one flops_by_kernel class on the cluster's devices: the
    device file's figure, or FALLBACK_EFFICIENCY labelled as such."""
    field, _ = KERNEL_PRICING[kernel_class]
    value = getattr(cluster, field)
    if value is None:
        return FALLBACK_EFFICIENCY, FALLBACK_SOURCE
    return value, getattr(cluster, f"{field}_source")


@dataclasses.dataclass(frozen=True)
class ComputePrice:
    """A step's compute priced per kernel class: `seconds` per device; `peak` the MFU peak
    (effective_peak: FP8-class FLOPs at the fp8 peak); `efficiency` = model FLOPs / (devices x
    peak x seconds), the one figure step_time takes; `source` names each class's figure."""

    seconds: float
    peak: float
    efficiency: float
    source: str


def price_compute(flops: Mapping[str, float], devices: int, cluster: Cluster, *,
                  imbalance: float = 1.0, recompute: float = 1.0) -> ComputePrice:
    """Seconds per device of a step whose model FLOPs (all devices) are split by kernel class
    (`flops`: metrics.flops.flops_by_kernel's keys x tokens): each class at its peak x its
    kernel_efficiency, the routed experts' classes `imbalance` times longer (the busiest shard
    sets the pace), all of it `recompute` times (remat re-runs the forward: 4/3)."""
    if devices < 1 or imbalance < 1 or recompute < 1:
        raise ValueError(f"price_compute: devices={devices}, imbalance={imbalance}, "
                         f"recompute={recompute} out of range")
    seconds, used = 0.0, []
    for kernel_class, n in flops.items():
        if not n:
            continue
        efficiency, source = kernel_efficiency(cluster, kernel_class)
        peak = getattr(cluster, KERNEL_PRICING[kernel_class][1])
        slow = imbalance if kernel_class.startswith("routed") else 1.0
        seconds += recompute * slow * n / (devices * peak * efficiency)
        used.append(f"{kernel_class} {efficiency:g} ({source})")
    total = sum(flops.values())
    fp8 = flops.get("gemm_fp8", 0.0) + flops.get("routed_fp8", 0.0)
    peak = effective_peak(total, fp8, cluster.peak_bf16_flops, cluster.peak_fp8_flops)
    efficiency = total / (devices * peak * seconds) if seconds else 1.0
    return ComputePrice(seconds, peak, efficiency, "; ".join(used))


def routed_all_to_all_bytes(tokens: float, experts_per_token: int, hidden: int,
                            dtype_bytes: float, expert_shards: int, shards_per_host: int,
                            exchanges: int, moe_layers: int) -> dict[str, float]:
    """{"ici": bytes, "dcn": bytes} one device sends per step in the expert dispatch and combine
    under balanced routing (each of its `tokens` tokens per MoE layer sends its
    `experts_per_token` assignments of `hidden` x `dtype_bytes` bytes, each to a uniformly
    random one of `expert_shards` shards, `shards_per_host` of them on its own host):
    exchanges x tokens x K x hidden x bytes x moe_layers, of which (shards_per_host - 1) /
    expert_shards stays inside the host and (expert_shards - shards_per_host) / expert_shards
    crosses hosts (the rest stays on the device). Why: collectives.py counts a ragged exchange as
    its whole buffer (c x rounds x T K rows), an upper bound; this is what routing sends."""
    if not 1 <= shards_per_host <= expert_shards or expert_shards % shards_per_host:
        raise ValueError(f"routed_all_to_all_bytes: shards_per_host={shards_per_host} does not "
                         f"divide expert_shards={expert_shards}")
    sent = exchanges * tokens * experts_per_token * hidden * dtype_bytes * moe_layers
    return {"ici": sent * (shards_per_host - 1) / expert_shards,
            "dcn": sent * (expert_shards - shards_per_host) / expert_shards}

def hosts_reached(experts: int, per_token: int, groups: int, groups_per_token: int,
                  hosts: int) -> float:
    """Expected number of the `hosts` hosts (each holding experts / hosts experts, whole groups
    when groups >= hosts) that one token's `per_token` experts lie on, under balanced
    group-limited routing: the token picks `groups_per_token` of `groups` expert groups
    uniformly, then its experts uniformly among those groups' experts (groups = 1: among all).
    What two_level's hop 1 sends a token to (once per host, parallel/two_level.py).
    DeepSeek-V3 (256 experts, top-8, 8 groups, top-4 groups, 8 hosts): 3.63."""
    if groups <= 1:
        groups = groups_per_token = 1
    if experts % groups or groups % hosts and hosts % groups or groups_per_token > groups:
        raise ValueError(f"hosts_reached: {experts} experts, {groups} groups "
                         f"({groups_per_token} a token), {hosts} hosts: groups must split "
                         "evenly over the hosts")
    per_group = experts // groups
    on_host = max(1, groups // hosts)  # groups a host holds (a group spans hosts: 1, split)
    split = max(1, hosts // groups)  # hosts one group spans
    chosen = groups_per_token * per_group  # experts the token draws from
    unused = 0.0  # P(none of the token's experts on one given host)
    for j in range(0, min(on_host, groups_per_token) + 1):  # chosen groups on that host
        p_j = (math.comb(on_host, j) * math.comb(groups - on_host, groups_per_token - j)
               / math.comb(groups, groups_per_token))
        there = j * per_group // split  # chosen experts on the host
        unused += p_j * math.comb(chosen - there, per_token) / math.comb(chosen, per_token)
    return hosts * (1.0 - unused)


# ---------------------------------------------------------------- the overlap assumption
# Fraction of the communication time hidden under compute (never more than the compute time).
# XLA's latency-hiding scheduler issues FSDP weight all-gathers and gradient reduce-scatters
# asynchronously beside the neighbouring layers' compute, so those hide well; the MoE
# dispatch/combine all-to-alls sit on the critical path between router and experts and hide only
# where micro-batches are interleaved (DeepSeek's DualPipe), which maxmoe does not do. Half is an
# assumption between those two until a GPU profile measures it (docs/performance/gpu.md, Overlap
# read from the XLA:GPU schedule). XLA:GPU
# plans read the exposed time from the compiled schedule instead (plan/overlap.py).
COMM_OVERLAP = 0.5

LINKS = ("ici", "dcn")
# params (f32, 4 B) + Adam's two moments (f32, 4 B each; optimizer.moment_dtype default) per param
CHECKPOINT_BYTES_PER_PARAM = 12


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one train step: step_s = compute_s + exposed_comm_s + bubble_s."""

    compute_s: float  # model FLOPs at efficiency x peak (price_compute's, per class)
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
              idle_fraction: float, *, efficiency: float = FALLBACK_EFFICIENCY,
              overlap: float = COMM_OVERLAP, peak: float | None = None,
              exposed_comm_s: float | None = None, pipelined: float = 1.0) -> StepTime:
    """Roofline step time of `devices` devices of `cluster` for a step of
    `model_flops_per_step` FLOPs (all devices together): compute at `efficiency` x `peak`
    (default the dense bf16 peak; price_compute gives both, per kernel class); each link class's
    bytes (link_bytes) over its bandwidth, the two classes in series; `overlap` of that hidden
    under compute. `idle_fraction` f is the share of the pipelined step a stage idles
    (model.spec.pipeline_idle: (P-1) / (V M + P-1) with padding): busy for the compute, idle
    for f of the total, so the bubble adds f / (1 - f) x compute (P = M = 16: 0.94x, not the
    0.48x that f x compute gave), of the `pipelined` share of the compute alone
    (metrics.flops.pipelined_share: what runs outside the pipeline idles no stage).
    `exposed_comm_s`, where given (read from XLA:GPU's compiled schedule, plan/overlap.py), is
    the exposed communication instead of `overlap`'s."""
    if devices < 1 or not 0 < efficiency <= 1 or not 0 <= overlap <= 1 \
            or not 0 <= idle_fraction < 1 or not 0 <= pipelined <= 1:
        raise ValueError(f"step_time: devices={devices}, efficiency={efficiency}, "
                         f"overlap={overlap}, idle_fraction={idle_fraction}, "
                         f"pipelined={pipelined} out of range")
    peak = cluster.peak_bf16_flops if peak is None else peak
    compute = model_flops_per_step / (devices * peak * efficiency)
    sent = link_bytes(collective_bytes)
    ici, dcn = sent["ici"] / cluster.ici_bandwidth, sent["dcn"] / cluster.dcn_bandwidth
    exposed = (ici + dcn) - min(overlap * (ici + dcn), compute) if exposed_comm_s is None \
        else exposed_comm_s
    bubble = idle_fraction / (1 - idle_fraction) * compute * pipelined
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
