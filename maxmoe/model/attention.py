"""Grouped-query attention with RoPE (optional per-head q/k norm), causal and packed-document
(segment id) masking. `make_attention` picks GQA or MLA (mla.py) from the config."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxmoe.config import AttentionConfig
from maxmoe.model.layers import RMSNorm, param
from maxmoe.model.rope import apply_rope
from maxmoe.sharding import shard


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, S] segment ids -> [B, 1, 1, S, S] bool: causal and never across documents."""
    s = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((s, s), bool))
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal[None] & same_doc)[:, None, None]


@jax.custom_vjp
def softmax(x: jax.Array) -> jax.Array:
    """Softmax over the last axis whose backward keeps only its output (jax.nn.softmax's
    linearisation also keeps exp(x - max), a second [B, H, S, T] residual per layer)."""
    return jax.nn.softmax(x, axis=-1)


def _softmax_fwd(x):
    y = jax.nn.softmax(x, axis=-1)
    return y, y


def _softmax_bwd(y, g):
    return (y * (g - jnp.sum(g * y, axis=-1, keepdims=True)),)


softmax.defvjp(_softmax_fwd, _softmax_bwd)

MASKED = -1e30  # float32 score of a masked pair: exp underflows to exactly 0


def masked_softmax_attention(scores: jax.Array, v: jax.Array, segment_ids: jax.Array,
                             dtype) -> jax.Array:
    """scores [B, K, G, S, T] float32 (already scaled), v [B, T, K, Dv] -> [B, S, K*G, Dv].

    Query head h = k*G + g uses kv head k (Hugging Face's repeat_kv order).
    """
    # an additive bias, not a select: the backward of `where` keeps a mask-sized residual per
    # layer (XLA materialised [L, B, K, G, S, T] zeros for it); the gradient of `+` is free.
    # Every row keeps its diagonal, so no row is all-masked.
    bias = jnp.where(attention_mask(segment_ids), 0.0, MASKED)
    scores = scores + bias
    probs = softmax(scores).astype(dtype)  # softmax in float32
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    b, s, k, g, dv = out.shape
    return out.reshape(b, s, k * g, dv)


def fused_attention(q, k, v, segment_ids):
    """q [B, S, H, Dh], k/v [B, T, K, Dh] -> [B, S, H, Dh] via jax.nn.dot_product_attention:
    cuDNN flash attention on GPU (causal skips the upper triangle; the document mask rides
    along as a [B, 1, S, T] mask), XLA elsewhere."""
    impl = "cudnn" if jax.devices()[0].platform == "gpu" else "xla"
    same_doc = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=same_doc, is_causal=True,
                                        implementation=impl)


class Attention(nnx.Module):
    def __init__(self, cfg: AttentionConfig, dim: int, *, std: float, dtype, rngs: nnx.Rngs,
                 norm_eps: float = 1e-6):
        h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q = param(rngs, (dim, h, hd), ("embed", "heads", "head_dim"), std)
        self.k = param(rngs, (dim, kv, hd), ("embed", "kv_heads", "head_dim"), std)
        self.v = param(rngs, (dim, kv, hd), ("embed", "kv_heads", "head_dim"), std)
        self.o = param(rngs, (h, hd, dim), ("heads", "head_dim", "embed"), std)
        # Qwen3: RMSNorm over each head's dims before RoPE keeps attention logits bounded
        self.q_norm = RMSNorm(hd, norm_eps, "head_dim") if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, norm_eps, "head_dim") if cfg.qk_norm else None
        self.cfg, self.dtype = cfg, dtype

    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """x [B, S, D] -> [B, S, D]."""
        cfg = self.cfg
        c = lambda p: p[...].astype(self.dtype)  # noqa: E731
        heads = ("batch", "seq", "act_heads", None)
        q = jnp.einsum("bsd,dhk->bshk", x, c(self.q))
        k = jnp.einsum("bsd,dhk->bshk", x, c(self.k))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = shard(apply_rope(q, positions, cfg), heads)
        k = shard(apply_rope(k, positions, cfg), heads)
        v = shard(jnp.einsum("bsd,dhk->bshk", x, c(self.v)), heads)
        # named for the save_named / offload_named remat policies (transformer.py)
        q, k, v = (checkpoint_name(t, "qkv_proj") for t in (q, k, v))
        b, s, _, hd = q.shape
        if cfg.implementation == "fused":
            out = fused_attention(q, k, v, segment_ids)
        else:
            groups = cfg.num_heads // cfg.num_kv_heads
            q = q.reshape(b, s, cfg.num_kv_heads, groups, hd)  # query head h uses kv head h // G
            scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32)
            out = masked_softmax_attention(scores * (hd ** -0.5), v, segment_ids, self.dtype)
        out = shard(out, heads)
        out = shard(jnp.einsum("bshk,hkd->bsd", out, c(self.o)), ("batch", "seq", "act_embed"))
        return checkpoint_name(out, "attn_out")


def make_attention(cfg: AttentionConfig, dim: int, *, std: float, dtype, rngs: nnx.Rngs,
                   norm_eps: float = 1e-6) -> nnx.Module:
    """GQA or MLA, as the config says; both map x [B, S, D] -> [B, S, D]."""
    if cfg.kind == "mla":
        from maxmoe.model.mla import LatentAttention

        return LatentAttention(cfg, dim, std=std, dtype=dtype, rngs=rngs)
    return Attention(cfg, dim, std=std, dtype=dtype, rngs=rngs, norm_eps=norm_eps)
