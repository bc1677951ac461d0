"""The decoding KV cache: its per-layer shapes, the write of new entries, and the mask of
which cached slots a new query may see (used by `extend` in attention.py, mla.py and
transformer.py; the decode loop is maxmoe/generate/decode.py).

A cache has T slots per sequence (the longest prompt plus the new tokens). Prompts are
left-padded: slot j of row b holds a real token when j >= pad[b], and a query at slot t sees
the real slots up to t. GQA caches roped keys and values [B, T, KV, Dh] each; MLA caches its
normed latent [B, T, C] and the roped shared key [B, T, R], not per-head keys or values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxmoe.config import AttentionConfig, ModelConfig
from maxmoe.kernels.attention import MASKED
from maxmoe.model.spec import layer_groups


def layer_cache_shapes(cfg: AttentionConfig, batch: int, length: int) -> tuple[tuple, tuple]:
    """The two cached arrays' shapes of one layer: GQA (k, v), MLA (latent, k_pe)."""
    if cfg.kind == "mla":
        return (batch, length, cfg.kv_lora_rank), (batch, length, cfg.qk_rope_head_dim)
    kv = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    return kv, kv


def init_cache(model: ModelConfig, attention: AttentionConfig, batch: int, length: int,
               dtype) -> list:
    """Zeros for every layer, one entry per layer group (model/spec.py): a stacked group
    (scan_layers) a pair of [L, ...] arrays, a per-layer group a list of L pairs."""
    shapes = layer_cache_shapes(attention, batch, length)
    caches: list = []
    for _, _, n in layer_groups(model):
        if model.scan_layers:
            caches.append(tuple(jnp.zeros((n, *s), dtype) for s in shapes))
        else:
            caches.append([tuple(jnp.zeros(s, dtype) for s in shapes) for _ in range(n)])
    return caches


def write(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """cache [B, T, ...] with new [B, S, ...] written at slots start..start+S-1."""
    return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), start, axis=1)


def cache_bias(start: jax.Array, queries: int, kv_valid: jax.Array) -> jax.Array:
    """[B, 1, S, T] float32 added to scores: 0 where the query at slot start + i may see key
    slot j (kv_valid[b, j], the slot holds a real token, and j <= start + i), MASKED
    elsewhere. A padding query sees nothing: its softmax is uniform, finite, and unused."""
    slots = jnp.arange(kv_valid.shape[1])
    causal = slots[None, :] <= start + jnp.arange(queries)[:, None]  # [S, T]
    return jnp.where(causal[None] & kv_valid[:, None, :], 0.0, MASKED)[:, None].astype(
        jnp.float32)
