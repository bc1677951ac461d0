"""Model FLOPs per token and the peak FLOP/s that MFU is measured against.

MFU = (model FLOPs per token x tokens per second) / (peak FLOP/s of all devices used).
Model FLOPs per token (FLOP_CONVENTION, docs/observability.md derives it next to MaxText's and
Megatron's):
6 x active params (incl. the LM head, router and norms, excl. the embedding lookup; MTP depths
added) + 3 x layers x heads x (qk + v head dims) x seq for the attention scores and values,
forward + backward, counted causally: half of the full S x S product, as MaxText
(`calculate_tflops_training_per_device`) and Megatron-Core count it, and as the blocked CPU
attention computes it. Rematerialisation is not counted (not useful work).

Under precision.fp8 (tensorwise / blockwise) MFU is counted per matmul class (MFU_CONVENTION):
MFU = sum over classes c of (FLOPs_c per second) / (peak FLOP/s of c's precision).
- FP8 class: the attention projections (GQA q/k/v/o; MLA q, q_a, q_b, kv_a, k_rope, k_nope, v,
  o), dense MLPs, shared experts and the top-k routed experts, in the main layers and in the MTP
  depths' blocks: 6 x their weights (`fp8_params_per_token`), against the FP8 peak of the GPU's
  configs/devices/ file (the one source of device peaks).
- BF16 class: everything else: LM head, router, norms, the attention core (scores and values),
  the MTP projection, against the bf16 peak. With fp8 = none everything is BF16 and MFU is the
  plain total FLOPs / bf16 peak, as before.
Where no FP8 peak is known (CPU, whose peak is measured; a peak given by
logging.peak_flops_per_device) the FP8 class is counted at the bf16 peak, and the peak's source
says so: a fall-back, not an error, since such a run still trains (XLA upcasts).

Peaks: logging.peak_flops_per_device if set; else a GPU's configs/devices/ file (found by its
device_name, cluster.device_kind); else, on CPU, a measured matmul (MatmulPeak). A GPU (or other
accelerator) kind with no file gets no MFU: one warning line names the kind and the file to add,
and the peak functions return None. A host matmul is no peak of an accelerator.
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp

from maxmoe.cluster import device_kind, kind_slug, load_device_kind
from maxmoe.config import Config
from maxmoe.model.spec import layer_groups
from maxmoe.parallel.schedule import pipeline_schedule


def attention_params(cfg: Config) -> int:
    """Params of one attention layer (GQA or MLA, incl. its internal norms)."""
    return attention_projection_params(cfg) + attention_norm_params(cfg)


def attention_norm_params(cfg: Config) -> int:
    """Params of one attention layer's internal norms (MLA's q_a / kv_a norms, GQA's qk-norm)."""
    a = cfg.attention
    if a.kind == "mla":
        return a.q_lora_rank + a.kv_lora_rank
    return 2 * a.head_dim if a.qk_norm else 0


def attention_projection_params(cfg: Config) -> int:
    """Weights of one attention layer's projections (GQA q/k/v/o; MLA q or q_a + q_b, kv_a,
    k_rope, k_nope, v, o): the matmuls precision.fp8 runs on E4M3."""
    a, d = cfg.attention, cfg.model.hidden_size
    if a.kind == "mla":
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = (d * a.q_lora_rank + a.q_lora_rank * a.num_heads * qk
             if a.q_lora_rank else d * a.num_heads * qk)
        kv = (d * (a.kv_lora_rank + a.qk_rope_head_dim)
              + a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim))
        return q + kv + a.num_heads * a.v_head_dim * d
    return d * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)


def block_active_params(cfg: Config, is_moe: bool) -> int:
    """Params one token passes through in one block: top-k routed + shared experts only."""
    m, e = cfg.model, cfg.moe
    d = m.hidden_size
    if is_moe:
        mlp = d * e.num_experts + 3 * d * e.expert_mlp_size * (e.experts_per_token + e.num_shared_experts)
    else:
        mlp = 3 * d * m.dense_mlp_size
    return attention_params(cfg) + mlp + 2 * d  # + the two pre-norms


def active_params_per_token(cfg: Config) -> int:
    """Params a token passes through in the main model (LM head and final norm included, the
    embedding lookup and the MTP depths excluded)."""
    m = cfg.model
    blocks = sum(n * block_active_params(cfg, is_moe) for is_moe, _, n in layer_groups(m))
    return blocks + m.hidden_size + m.hidden_size * m.vocab_size


def mtp_active_params_per_token(cfg: Config) -> int:
    """Per-token params of the MTP depths, counting the shared LM head again (it is recomputed)."""
    d = cfg.model.hidden_size
    last_is_moe = layer_groups(cfg.model)[-1][0]
    per_depth = block_active_params(cfg, last_is_moe) + 2 * d * d + 3 * d + d * cfg.model.vocab_size
    return cfg.model.mtp_depth * per_depth


FLOP_CONVENTION = "6 x active params + causal attention (half of S^2; MaxText/Megatron)"


def _pipelined_groups(cfg: Config, stages: int) -> list[tuple[float, float]]:
    """(model FLOPs a token costs in the group's layers, forwards each is run again:
    `pipelined_reruns`) of each layer group a pipeline of `stages` stages runs."""
    m = cfg.model
    schedule = pipeline_schedule(m, stages)
    layer = attention_flops_per_token(cfg) / (m.num_layers + m.mtp_depth)  # + 6 x params
    return [(n * (6 * block_active_params(cfg, is_moe) + layer),
             pipelined_reruns(m.remat_policy, schedule.slots(n)))
            for is_moe, _, n in layer_groups(m) if schedule.pipelines(n)]


def recompute_factor(cfg: Config, stages: int) -> float:
    """FLOPs a step runs over its model FLOPs (FLOP_CONVENTION counts one forward, 2 of 6):
    1 + 1/3 for each forward run again, each layer weighted by its share of the FLOPs a token
    costs. model.remat_policy other than none re-runs a block's forward once in the backward
    (an upper bound for the policies that save some tensors). A layer a pipeline of `stages`
    stages runs is `pipelined_reruns` times."""
    remat = float(cfg.model.remat_policy != "none")
    extra = sum(f * (reruns - remat) for f, reruns in _pipelined_groups(cfg, stages))
    return 1 + (remat + extra / flops_per_token(cfg)) / 3


def pipelined_share(cfg: Config, stages: int) -> float:
    """The share of the FLOPs a step runs (recompute_factor's, re-runs included) that the
    layers pipelined on `stages` stages take: the compute beside which the pipeline's bubble
    idles. The embedding, a dense prefix run on every stage, the LM head, loss and MTP run
    outside the pipeline, every stage busy. 0 where no group is pipelined. A share of FLOPs,
    standing in for the share of compute time (the kernel classes' efficiencies differ a
    little between the two parts)."""
    piped = sum(f * (1 + reruns / 3) for f, reruns in _pipelined_groups(cfg, stages))
    return piped / (flops_per_token(cfg) * recompute_factor(cfg, stages))


def pipelined_reruns(remat: str, slots: int) -> float:
    """Forwards the backward runs again per layer of a pipeline stage of `slots` slots. Under
    remat full (model/block.RERUNS_WHOLE_BLOCK) the pipeline's backward runs each iteration's
    slots but the last forward one iteration ahead, to give the next its slot inputs
    (parallel/pipeline_loop.Loop), and each block's vjp re-runs the block: 1 + (S - 1) / S, on
    every compiler (plus one unread pass a step, 1 / (V M + P - 1) of them: left out). Under a
    policy that saves tensors (dots, save_named, offload_named) a backward iteration runs its
    pass forward once, saving them, and each block re-runs the rest: counted as full (an upper
    bound). Without block remat the pass's one forward keeps every slot's residuals;
    save_received is counted at 2 (an upper bound: the forward keeps what hop 1 received)."""
    if remat == "none":
        return 1.0
    if remat == "save_received":
        return 2.0
    return 1.0 + (slots - 1) / slots


def attention_flops_per_token(cfg: Config) -> float:
    """Attention-core FLOPs (q.k scores and p.v values, forward + backward) a token costs over
    all layers and MTP depths: 6 x heads x (qk + v) x seq per layer for the full S x S product,
    halved for the causal mask."""
    a, m = cfg.attention, cfg.model
    if a.kind == "mla":
        qk, v = a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
    else:
        qk = v = a.head_dim
    layers = m.num_layers + m.mtp_depth
    return 6 * layers * a.num_heads * (qk + v) * cfg.data.seq_len / 2


def flops_per_token(cfg: Config) -> float:
    """Model FLOPs per trained token (FLOP_CONVENTION)."""
    params = active_params_per_token(cfg) + mtp_active_params_per_token(cfg)
    return 6.0 * params + attention_flops_per_token(cfg)


MFU_CONVENTION = ("sum over matmul classes of FLOPs / peak of the class's precision "
                  "(fp8: attention projections, MLPs, experts; bf16: the rest)")


def block_fp8_params(cfg: Config, is_moe: bool) -> int:
    """Weights one token passes through in one block whose matmuls run on E4M3 when
    precision.fp8 is on: attention projections + the dense MLP, or the top-k routed and the
    shared experts (not the router, not the norms)."""
    m, e = cfg.model, cfg.moe
    d = m.hidden_size
    mlp = (3 * d * e.expert_mlp_size * (e.experts_per_token + e.num_shared_experts) if is_moe
           else 3 * d * m.dense_mlp_size)
    return attention_projection_params(cfg) + mlp


def fp8_params_per_token(cfg: Config) -> int:
    """Per-token weights of the FP8 class (module docstring) over the main layers and the MTP
    depths' blocks (each MTP block is of the last layer's kind); 0 when precision.fp8 is none."""
    if cfg.precision.fp8 == "none":
        return 0
    m = cfg.model
    groups = layer_groups(m)
    blocks = sum(n * block_fp8_params(cfg, is_moe) for is_moe, _, n in groups)
    return blocks + m.mtp_depth * block_fp8_params(cfg, groups[-1][0])


def flops_by_precision(cfg: Config) -> dict[str, float]:
    """{"bf16": FLOPs, "fp8": FLOPs} per trained token: the split of flops_per_token (they sum
    to it exactly) by the precision each matmul runs in under precision.fp8."""
    fp8 = 6.0 * fp8_params_per_token(cfg)
    return {"bf16": flops_per_token(cfg) - fp8, "fp8": fp8}


KERNEL_CLASSES = ("attention", "gemm_bf16", "gemm_fp8", "routed_bf16", "routed_fp8")


def routed_params_per_token(cfg: Config) -> int:
    """Routed-expert weights a token passes through: top-k experts x 3 D F per MoE layer, in the
    main layers and the MTP depths (each of the last layer's kind). Shared experts excluded."""
    m, e = cfg.model, cfg.moe
    groups = layer_groups(m)
    layers = sum(n for is_moe, _, n in groups if is_moe) + (m.mtp_depth if groups[-1][0] else 0)
    return layers * 3 * m.hidden_size * e.expert_mlp_size * e.experts_per_token


def flops_by_kernel(cfg: Config, routed_in_fp8: bool = True) -> dict[str, float]:
    """Model FLOPs per trained token by the kernel that runs them (KERNEL_CLASSES; they sum to
    flops_per_token exactly): the causal attention core (bf16 under every precision.fp8), the
    routed experts' grouped GEMMs (routed_fp8 when precision.fp8 is on and `routed_in_fp8`,
    else routed_bf16: the slowest expert shard sets their pace) and the other GEMMs of each
    precision. routed_in_fp8 False: the grouped kernel runs FP8's values in 16-bit math
    (kernels/fp8_ragged.dequantised_ragged_dot, tokamax's on SM90). Why: the planner prices
    each class at its own kernel-level efficiency and peak (plan/roofline.py)."""
    attention = attention_flops_per_token(cfg)
    routed = 6.0 * routed_params_per_token(cfg)
    fp8 = flops_by_precision(cfg)["fp8"]  # includes the routed experts when on
    routed_fp8, routed_bf16 = (routed, 0.0) if fp8 and routed_in_fp8 else (0.0, routed)
    other_fp8 = fp8 - routed if fp8 else 0.0  # the non-routed GEMMs in FP8
    return {"attention": attention,
            "gemm_bf16": flops_per_token(cfg) - attention - routed - other_fp8,
            "gemm_fp8": other_fp8, "routed_bf16": routed_bf16, "routed_fp8": routed_fp8}


def class_seconds(flops: dict[str, float], peaks: dict[str, float]) -> float:
    """Seconds the FLOPs of each class (flops_by_precision's keys) take at its peak:
    sum_c flops[c] / peaks[c]; a class with no FLOPs needs no peak."""
    return sum(f / peaks[c] for c, f in flops.items() if f)


def mfu(flops: dict[str, float], seconds: float, peaks: dict[str, float]) -> float:
    """MFU_CONVENTION: sum over classes of flops[c] / seconds / peaks[c] (flops per step and
    peaks of all devices, or both per device), computed as total / seconds / effective_peak:
    all-bf16 FLOPs give exactly total / seconds / bf16 peak."""
    return sum(flops.values()) / seconds / effective_peak(flops, peaks)


def effective_peak(flops: dict[str, float], peaks: dict[str, float]) -> float:
    """The one peak that gives MFU_CONVENTION's MFU as total FLOPs / time / peak:
    total / class_seconds; exactly peaks["bf16"] when no FLOPs are FP8."""
    if not flops.get("fp8"):
        return peaks["bf16"]
    return sum(flops.values()) / class_seconds(flops, peaks)


class MatmulPeak:
    """The practical peak of this host: the best FLOP/s a jitted square matmul reached in any
    of the runs `sample` timed. Best, not median: noise on a shared machine only ever slows a
    run down. `maxmoe bench` also samples it between its steps, so that a busy spell during
    one burst of runs cannot set the peak low and the MFU high (docs/performance/planning.md, CPU
    reference shape and MFU)."""

    def __init__(self, dtype=jnp.float32, size: int = 2048):
        self.x = jax.device_put(jnp.ones((size, size), dtype), jax.devices()[0])
        self.f = jax.jit(lambda a: a @ a)
        self.f(self.x).block_until_ready()
        self.flops, self.best, self.count = 2 * size**3, 0.0, 0
        self.label = f"{jnp.dtype(dtype).name} {size}x{size} matmul"

    def sample(self, repeats: int = 1) -> float:
        for _ in range(repeats):
            t = time.perf_counter()
            self.f(self.x).block_until_ready()
            self.best = max(self.best, self.flops / (time.perf_counter() - t))
            self.count += 1
        return self.best

    def source(self) -> str:
        return f"best {self.label} of {self.count} on this host"


def _data_sheet_peak(precision: str = "bf16") -> tuple[float, str] | None:
    """(dense peak FLOP/s per device of `precision`, its source) from the accelerator's
    configs/devices/ file (cluster.device_kind); None on CPU or for a kind with no file."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return None
    _, name = device_kind()
    if name is None:
        return None
    fields, _ = load_device_kind(name)
    return fields[f"peak_{precision}_flops"], f"{device.device_kind} {precision} data-sheet peak"


def unknown_accelerator() -> str | None:
    """jax's device_kind of this job's devices when they are accelerators (not CPUs) with no
    configs/devices/ file, else None."""
    kind, name = device_kind()
    return kind if name is None else None


@functools.cache
def _warn_no_peak(kind: str) -> None:
    """The one warning line (per process 0, per kind) that MFU is left out."""
    if jax.process_index() == 0:
        print(f"maxmoe: warning: device kind {kind!r} has no configs/devices/ file, so MFU is "
              f"left out; add configs/devices/{kind_slug(kind)}.yaml with device_name: "
              f"\"{kind}\" and its data-sheet peaks (copy configs/devices/h100.yaml and its "
              "sources) or set logging.peak_flops_per_device", file=sys.stderr)


def _no_peak(cfg: Config) -> bool:
    """True (after the one warning) where MFU is left out: an accelerator with no devices file
    and no logging.peak_flops_per_device."""
    kind = None if cfg.logging.peak_flops_per_device > 0 else unknown_accelerator()
    if kind is not None:
        _warn_no_peak(kind)
    return kind is not None


def peak_meter(cfg: Config) -> MatmulPeak | None:
    """The meter peak_flops measures this config's peak with (CPU only); None where the peak
    is given (logging.peak_flops_per_device or a GPU's data sheet) or left out (_no_peak)."""
    if (cfg.logging.peak_flops_per_device > 0 or _data_sheet_peak() is not None
            or _no_peak(cfg)):
        return None
    # fake CPU devices share the host's cores: the host peak is the peak of all of them;
    # a bfloat16 run against a bfloat16 matmul
    return MatmulPeak(jnp.dtype(cfg.precision.compute_dtype))


def peak_flops(cfg: Config, meter: MatmulPeak | None = None) -> tuple[float, str] | None:
    """(peak FLOP/s of all devices together, how it was obtained); None where MFU is left out
    (an accelerator kind with no devices file: one warning). Measured (CPU): 10 more runs of
    `meter` (default a new peak_meter(cfg)), the best of them and of all it timed before."""
    n = jax.device_count()
    if cfg.logging.peak_flops_per_device > 0:
        return cfg.logging.peak_flops_per_device * n, "logging.peak_flops_per_device"
    sheet = _data_sheet_peak()
    if sheet is not None:
        return sheet[0] * n, sheet[1]
    if _no_peak(cfg):
        return None
    meter = meter or peak_meter(cfg)
    return meter.sample(10), meter.source()


def fp8_peak_flops(cfg: Config, bf16: tuple[float, str] | None) -> tuple[float, str] | None:
    """(FP8 peak FLOP/s of all devices, how it was obtained): the GPU's FP8 data sheet where
    the bf16 peak came from the data sheet too, else `bf16` (peak_flops' result) again, its
    source saying that FP8 GEMMs are counted at the bf16 peak (module docstring); None when
    `bf16` is None."""
    if bf16 is None:
        return None
    sheet = _data_sheet_peak("fp8")
    if cfg.logging.peak_flops_per_device <= 0 and sheet is not None:
        return sheet[0] * jax.device_count(), sheet[1]
    return bf16[0], f"no fp8 peak known: the bf16 one ({bf16[1]})"


def mfu_peak(cfg: Config) -> tuple[float, str] | None:
    """(peak FLOP/s of all devices, how it was obtained) that a run's total FLOP/s is divided by
    for MFU_CONVENTION's MFU: effective_peak of the config's flops_by_precision over the bf16
    peak (peak_flops(cfg)) and fp8_peak_flops; with precision.fp8 none (or no FP8 peak known)
    exactly the bf16 peak; None where MFU is left out (peak_flops). The training loop's MFU
    (and progress bar) uses it, so it counts as `maxmoe bench` (bench.mfu_figures) does."""
    bf16 = peak_flops(cfg)
    if bf16 is None:
        return None
    fp8 = fp8_peak_flops(cfg, bf16)
    peak = effective_peak(flops_by_precision(cfg), {"bf16": bf16[0], "fp8": fp8[0]})
    if cfg.precision.fp8 == "none":
        return peak, bf16[1]
    return peak, (f"effective: fp8-class FLOPs at {fp8[0]:.3e} ({fp8[1]}), the rest at "
                  f"{bf16[0]:.3e} ({bf16[1]})")
