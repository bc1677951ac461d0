"""Model FLOPs per token and the peak FLOP/s that MFU is measured against.

MFU = (model FLOPs per token x tokens per second) / (peak FLOP/s of all devices used).
Model FLOPs follow the PaLM convention: 6 x (active matmul params, incl. LM head, excl. the
embedding lookup) + 12 x layers x heads x head_dim x seq (attention scores and values,
forward + backward, non-causal count). Rematerialisation is not counted (it is not useful work).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from maxmoe.config import Config

# dense bf16 peak per device (no sparsity), from vendor data sheets
GPU_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}


def active_params_per_token(cfg: Config) -> int:
    """Matmul parameters a token passes through (top-k routed + shared experts only)."""
    m, a, e = cfg.model, cfg.attention, cfg.moe
    d = m.hidden_size
    attention = d * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)
    dense_mlp = 3 * d * m.dense_mlp_size
    moe_mlp = d * e.num_experts + 3 * d * e.expert_mlp_size * (e.experts_per_token + e.num_shared_experts)
    n_dense = m.num_dense_layers
    n_moe = m.num_layers - n_dense
    return m.num_layers * attention + n_dense * dense_mlp + n_moe * moe_mlp + d * m.vocab_size


def flops_per_token(cfg: Config) -> float:
    a = cfg.attention
    attention_scores = 12 * cfg.model.num_layers * a.num_heads * a.head_dim * cfg.data.seq_len
    return 6.0 * active_params_per_token(cfg) + attention_scores


def measure_matmul_peak(dtype=jnp.float32, size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a jitted square matmul on one device: the practical peak of this host."""
    x = jax.device_put(jnp.ones((size, size), dtype), jax.devices()[0])
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * size**3 / float(np.median(times))


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
    return measure_matmul_peak(), "measured float32 1024x1024 matmul on this host"
