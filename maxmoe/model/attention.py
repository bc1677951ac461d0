"""Grouped-query attention with RoPE (optional per-head q/k norm), causal and packed-document
(segment id) masking; the kernels are in kernels/attention.py. `make_attention` picks GQA or
MLA (mla.py) from the config."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxmoe.config import AttentionConfig
from maxmoe.kernels import tokamax_ops
from maxmoe.kernels.attention import attention_core, fused_attention, resolve_implementation
from maxmoe.kernels.fp8 import project
from maxmoe.model import kv_cache
from maxmoe.model.layers import RMSNorm, param
from maxmoe.model.mla import LatentAttention
from maxmoe.model.rope import apply_rope
from maxmoe.sharding import shard


class Attention(nnx.Module):
    def __init__(self, cfg: AttentionConfig, dim: int, *, std: float, dtype, rngs: nnx.Rngs,
                 norm_eps: float = 1e-6, fp8: str = "none"):
        h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q = param(rngs, (dim, h, hd), ("embed", "heads", "head_dim"), std)
        self.k = param(rngs, (dim, kv, hd), ("embed", "kv_heads", "head_dim"), std)
        self.v = param(rngs, (dim, kv, hd), ("embed", "kv_heads", "head_dim"), std)
        self.o = param(rngs, (h, hd, dim), ("heads", "head_dim", "embed"), std)
        # Qwen3: RMSNorm over each head's dims before RoPE keeps attention logits bounded
        self.q_norm = RMSNorm(hd, norm_eps, "head_dim") if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, norm_eps, "head_dim") if cfg.qk_norm else None
        self.cfg, self.dtype, self.fp8 = cfg, dtype, fp8  # fp8: precision.fp8

    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """x [B, S, D] -> [B, S, D]."""
        cfg = self.cfg
        c = lambda p: p[...].astype(self.dtype)  # noqa: E731
        heads = ("batch", "seq", "act_heads", None)
        with jax.named_scope("projection"):  # the profile's "attention: projections"
            q, k, v = (project(x, c(w), self.fp8, "bsd,dhk->bshk") for w in (self.q, self.k, self.v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = shard(apply_rope(q, positions, cfg), heads)
        k = shard(apply_rope(k, positions, cfg), heads)
        v = shard(v, heads)
        # named for the save_named / offload_named remat policies (transformer.py)
        q, k, v = (checkpoint_name(t, "qkv_proj") for t in (q, k, v))
        b, s, _, hd = q.shape
        implementation = resolve_implementation(cfg.implementation, q.dtype)
        tokamax_ops.log_kernel("attention", implementation)
        if implementation in ("fused", "tokamax"):
            out = (fused_attention(q, k, v, segment_ids) if implementation == "fused" else
                   tokamax_ops.attention(q, k, v, segment_ids, hd ** -0.5))
            out = shard(out, heads)
            with jax.named_scope("projection"):
                out = project(out, c(self.o), self.fp8, "bshk,hkd->bsd")
        else:
            groups = cfg.num_heads // cfg.num_kv_heads
            # query head h uses kv head h // G; the scale folded into q (4x smaller than scores)
            q = (q * hd ** -0.5).reshape(b, s, cfg.num_kv_heads, groups, hd)
            q = q.transpose(0, 2, 3, 1, 4)  # [B, K, G, S, Dh]
            out = attention_core(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), segment_ids,
                                 cfg.causal_block_size).reshape(b, cfg.num_heads, s, -1)
            out = shard(out, ("batch", "act_heads", "seq", None))
            with jax.named_scope("projection"):
                out = project(out, c(self.o), self.fp8, "bhsk,hkd->bsd")
        out = shard(out, ("batch", "seq", "act_embed"))
        return checkpoint_name(out, "attn_out")


    def extend(self, x, positions, cache, start, kv_valid):
        """Decoding with a KV cache: x [B, S, D] are the tokens of cache slots start..start+S-1
        at positions [B, S]; cache (k, v) [B, T, KV, Dh] (roped keys); kv_valid [B, T] the
        slots holding real tokens (model/kv_cache.py) -> (out [B, S, D], updated cache)."""
        cfg = self.cfg
        c = lambda p: p[...].astype(self.dtype)  # noqa: E731
        heads = ("batch", "seq", "act_heads", None)
        q, k, v = (jnp.einsum("bsd,dhk->bshk", x, c(w)) for w in (self.q, self.k, self.v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        length = cache[0].shape[1]
        q = shard(apply_rope(q, positions, cfg, length), heads)
        cache = (kv_cache.write(cache[0], apply_rope(k, positions, cfg, length), start),
                 kv_cache.write(cache[1], v, start))
        b, s, _, hd = q.shape
        q = (q * hd ** -0.5).reshape(b, s, cfg.num_kv_heads, -1, hd)  # [B, S, K, G, Dh]
        scores = jnp.einsum("bskgd,btkd->bkgst", q, cache[0], preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(scores + kv_cache.cache_bias(start, s, kv_valid)[:, :, None], -1)
        out = jnp.einsum("bkgst,btkd->bskgd", probs.astype(cache[1].dtype), cache[1])
        out = shard(out.reshape(b, s, cfg.num_heads, -1), heads)
        out = jnp.einsum("bshk,hkd->bsd", out, c(self.o))
        return shard(out, ("batch", "seq", "act_embed")), cache


def make_attention(cfg: AttentionConfig, dim: int, *, std: float, dtype, rngs: nnx.Rngs,
                   norm_eps: float = 1e-6, fp8: str = "none") -> nnx.Module:
    """GQA or MLA, as the config says; both map x [B, S, D] -> [B, S, D]."""
    if cfg.kind == "mla":
        return LatentAttention(cfg, dim, std=std, dtype=dtype, rngs=rngs, fp8=fp8)
    return Attention(cfg, dim, std=std, dtype=dtype, rngs=rngs, norm_eps=norm_eps, fp8=fp8)
