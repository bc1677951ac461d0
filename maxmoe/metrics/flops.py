"""Model FLOPs per token and the peak FLOP/s that MFU is measured against.

MFU = (model FLOPs per token x tokens per second) / (peak FLOP/s of all devices used).
Model FLOPs per token (FLOP_CONVENTION, the README derives it next to MaxText's and Megatron's):
6 x active params (incl. the LM head, router and norms, excl. the embedding lookup; MTP depths
added) + 3 x layers x heads x (qk + v head dims) x seq for the attention scores and values,
forward + backward, counted causally: half of the full S x S product, as MaxText
(`calculate_tflops_training_per_device`) and Megatron-Core count it, and as the blocked CPU
attention computes it. Rematerialisation is not counted (not useful work).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from maxmoe.config import Config
from maxmoe.model.spec import layer_groups

# dense bf16 peak per device (no sparsity), from vendor data sheets
GPU_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}


def attention_params(cfg: Config) -> int:
    """Params of one attention layer (GQA or MLA, incl. its internal norms)."""
    a, d = cfg.attention, cfg.model.hidden_size
    if a.kind == "mla":
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = (d * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * a.num_heads * qk
             if a.q_lora_rank else d * a.num_heads * qk)
        kv = (d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
              + a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim))
        return q + kv + a.num_heads * a.v_head_dim * d
    norms = 2 * a.head_dim if a.qk_norm else 0
    return d * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads) + norms


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


class MatmulPeak:
    """The practical peak of this host: the best FLOP/s a jitted square matmul reached in any
    of the runs `sample` timed. Best, not median: noise on a shared machine only ever slows a
    run down. `maxmoe bench` also samples it between its steps, so that a busy spell during
    one burst of runs cannot set the peak low and the MFU high (docs/performance.md, CPU
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


def _data_sheet_peak() -> tuple[float, str] | None:
    device = jax.devices()[0]
    if device.platform == "gpu":
        for name, peak in GPU_PEAK_BF16.items():
            if name in device.device_kind:
                return peak, f"{device.device_kind} bf16 data-sheet peak"
    return None


def peak_meter(cfg: Config) -> MatmulPeak | None:
    """The meter peak_flops measures this config's peak with; None where the peak is given
    (logging.peak_flops_per_device or a GPU's data sheet)."""
    if cfg.logging.peak_flops_per_device > 0 or _data_sheet_peak() is not None:
        return None
    # fake CPU devices share the host's cores: the host peak is the peak of all of them;
    # a bfloat16 run against a bfloat16 matmul
    return MatmulPeak(jnp.dtype(cfg.precision.compute_dtype))


def peak_flops(cfg: Config, meter: MatmulPeak | None = None) -> tuple[float, str]:
    """(peak FLOP/s of all devices together, how it was obtained). Measured: 10 more runs of
    `meter` (default a new peak_meter(cfg)), the best of them and of all it timed before."""
    n = jax.device_count()
    if cfg.logging.peak_flops_per_device > 0:
        return cfg.logging.peak_flops_per_device * n, "logging.peak_flops_per_device"
    sheet = _data_sheet_peak()
    if sheet is not None:
        return sheet[0] * n, sheet[1]
    meter = meter or peak_meter(cfg)
    return meter.sample(10), meter.source()
