"""Grouped-query attention with RoPE, causal and packed-document (segment id) masking."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxmoe.config import AttentionConfig
from maxmoe.model.layers import param, rope
from maxmoe.sharding import shard


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, S] segment ids -> [B, 1, 1, S, S] bool: causal and never across documents."""
    s = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((s, s), bool))
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal[None] & same_doc)[:, None, None]


class Attention(nnx.Module):
    def __init__(self, cfg: AttentionConfig, dim: int, *, std: float, dtype, rngs: nnx.Rngs):
        h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q = param(rngs, (dim, h, hd), ("embed", "heads", "head_dim"), std)
        self.k = param(rngs, (dim, kv, hd), ("embed", "kv_heads", "head_dim"), std)
        self.v = param(rngs, (dim, kv, hd), ("embed", "kv_heads", "head_dim"), std)
        self.o = param(rngs, (h, hd, dim), ("heads", "head_dim", "embed"), std)
        self.cfg, self.dtype = cfg, dtype

    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        cfg = self.cfg
        c = lambda p: p[...].astype(self.dtype)  # noqa: E731
        heads = ("batch", "seq", "act_heads", None)
        q = shard(rope(jnp.einsum("bsd,dhk->bshk", x, c(self.q)), positions, cfg.rope_theta), heads)
        k = shard(rope(jnp.einsum("bsd,dhk->bshk", x, c(self.k)), positions, cfg.rope_theta), heads)
        v = shard(jnp.einsum("bsd,dhk->bshk", x, c(self.v)), heads)
        b, s, _, hd = q.shape
        groups = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape(b, s, cfg.num_kv_heads, groups, hd)  # query head h uses kv head h // G
        scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32)
        scores = scores * (hd ** -0.5)
        scores = jnp.where(attention_mask(segment_ids), scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)  # softmax in float32
        out = jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, s, cfg.num_heads, hd)
        out = shard(out, heads)
        return shard(jnp.einsum("bshk,hkd->bsd", out, c(self.o)), ("batch", "seq", "act_embed"))
