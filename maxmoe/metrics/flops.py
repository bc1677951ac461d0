"""Model FLOPs per token and the peak FLOP/s that MFU is measured against.

MFU = (model FLOPs per token x tokens per second) / (peak FLOP/s of all devices used).
Model FLOPs follow the PaLM convention: 6 x (active params, incl. LM head, excl. the embedding
lookup; MTP depths added) + 6 x layers x heads x (qk + v head dims) x seq (attention scores and
values, forward + backward, non-causal count). Rematerialisation is not counted (not useful work).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from maxmoe.config import Config

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
    from maxmoe.model.transformer import layer_groups

    m = cfg.model
    blocks = sum(n * block_active_params(cfg, is_moe) for is_moe, _, n in layer_groups(m))
    return blocks + m.hidden_size + m.hidden_size * m.vocab_size


def mtp_active_params_per_token(cfg: Config) -> int:
    """Per-token params of the MTP depths, counting the shared LM head again (it is recomputed)."""
    from maxmoe.model.transformer import layer_groups

    d = cfg.model.hidden_size
    last_is_moe = layer_groups(cfg.model)[-1][0]
    per_depth = block_active_params(cfg, last_is_moe) + 2 * d * d + 3 * d + d * cfg.model.vocab_size
    return cfg.model.mtp_depth * per_depth


def flops_per_token(cfg: Config) -> float:
    a, m = cfg.attention, cfg.model
    if a.kind == "mla":
        qk, v = a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
    else:
        qk = v = a.head_dim
    # scores (q.k) and values (p.v), forward + backward: 6 x heads x (qk + v) x seq per layer
    layers = m.num_layers + m.mtp_depth
    attention_scores = 6 * layers * a.num_heads * (qk + v) * cfg.data.seq_len
    params = active_params_per_token(cfg) + mtp_active_params_per_token(cfg)
    return 6.0 * params + attention_scores


def measure_matmul_peak(dtype=jnp.float32, size: int = 2048, repeats: int = 10) -> float:
    """FLOP/s of a jitted square matmul on one device: the practical peak of this host.

    The best of `repeats` runs: noise on a shared machine only ever slows a run down, and the
    median of a few 1024^2 runs moved by +-15% between runs here, and the MFU with it."""
    x = jax.device_put(jnp.ones((size, size), dtype), jax.devices()[0])
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * size**3 / best


def peak_flops(cfg: Config) -> tuple[float, str]:
    """(peak FLOP/s of all devices together, how it was obtained)."""
    n = jax.device_count()
    if cfg.logging.peak_flops_per_device > 0:
        return cfg.logging.peak_flops_per_device * n, "logging.peak_flops_per_device"
    device = jax.devices()[0]
    if device.platform == "gpu":
        for name, peak in GPU_PEAK_BF16.items():
            if name in device.device_kind:
                return peak * n, f"{device.device_kind} bf16 data-sheet peak"
    # fake CPU devices share the host's cores: the host peak is the peak of all of them
    dtype = jnp.dtype(cfg.precision.compute_dtype)  # a bfloat16 run against a bfloat16 matmul
    return measure_matmul_peak(dtype), f"best {dtype.name} 2048x2048 matmul of 10 on this host"
