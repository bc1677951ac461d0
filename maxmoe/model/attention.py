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


def attention_mask(segment_ids: jax.Array, lo: int = 0, hi: int | None = None) -> jax.Array:
    """[B, S] segment ids -> [B, 1, 1, hi - lo, hi] bool for queries lo:hi against keys :hi
    (default all S): causal and never across documents."""
    hi = segment_ids.shape[1] if hi is None else hi
    causal = jnp.arange(lo, hi)[:, None] >= jnp.arange(hi)[None, :]
    same_doc = segment_ids[:, lo:hi, None] == segment_ids[:, None, :hi]
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


def causal_attention(scores, v: jax.Array, segment_ids: jax.Array, dtype,
                     block_size: int = 0) -> jax.Array:
    """Causal softmax attention that never crosses documents, in blocks of `block_size` queries
    (0: one block).

    scores(lo, hi) -> float32 scaled scores [B, K, G, hi - lo, hi] of queries lo:hi against
    keys :hi; v [B, K, T, Dv]. Returns [B, K*G, S, Dv]; query head h = k*G + g uses kv head k
    (Hugging Face's repeat_kv order). A query block meets only the keys up to its own end, so
    the blocks above the diagonal are never computed: n blocks skip (n - 1) / 2n of the scores
    (issue 8, CPU, sequence 1024: train step 568 -> 463 ms with 4 blocks instead of one;
    sequence 256: 365 -> 349 ms with 2 blocks of 128, the default).
    """
    s = segment_ids.shape[1]
    size = block_size if 0 < block_size < s else s
    outs = []
    for lo in range(0, s, size):
        hi = min(lo + size, s)
        # an additive bias, not a select: the backward of `where` keeps a mask-sized residual
        # per layer (XLA materialised [L, B, K, G, S, T] zeros for it); the gradient of `+` is
        # free. Every row keeps its diagonal, so no row is all-masked.
        bias = jnp.where(attention_mask(segment_ids, lo, hi), 0.0, MASKED)
        probs = softmax(scores(lo, hi) + bias).astype(dtype)  # softmax in float32
        outs.append(jnp.einsum("bkgst,bktd->bkgsd", probs, v[:, :, :hi]))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    b, k, g, _, dv = out.shape
    return out.reshape(b, k * g, s, dv)


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
        with jax.named_scope("projection"):  # the profile's "attention: projections"
            q, k, v = (jnp.einsum("bsd,dhk->bshk", x, c(w)) for w in (self.q, self.k, self.v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = shard(apply_rope(q, positions, cfg), heads)
        k = shard(apply_rope(k, positions, cfg), heads)
        v = shard(v, heads)
        # named for the save_named / offload_named remat policies (transformer.py)
        q, k, v = (checkpoint_name(t, "qkv_proj") for t in (q, k, v))
        b, s, _, hd = q.shape
        if cfg.implementation == "fused":
            out = shard(fused_attention(q, k, v, segment_ids), heads)
            with jax.named_scope("projection"):
                out = jnp.einsum("bshk,hkd->bsd", out, c(self.o))
        else:
            groups = cfg.num_heads // cfg.num_kv_heads
            # query head h uses kv head h // G; the scale folded into q (4x smaller than scores)
            q = (q * hd ** -0.5).reshape(b, s, cfg.num_kv_heads, groups, hd)
            q = q.transpose(0, 2, 3, 1, 4)  # [B, K, G, S, Dh]
            k = k.transpose(0, 2, 1, 3)
            out = causal_attention(
                lambda lo, hi: jnp.einsum("bkgsd,bktd->bkgst", q[:, :, :, lo:hi], k[:, :, :hi],
                                          preferred_element_type=jnp.float32),
                v.transpose(0, 2, 1, 3), segment_ids, self.dtype, cfg.causal_block_size)
            out = shard(out, ("batch", "act_heads", "seq", None))
            with jax.named_scope("projection"):
                out = jnp.einsum("bhsk,hkd->bsd", out, c(self.o))
        out = shard(out, ("batch", "seq", "act_embed"))
        return checkpoint_name(out, "attn_out")


def make_attention(cfg: AttentionConfig, dim: int, *, std: float, dtype, rngs: nnx.Rngs,
                   norm_eps: float = 1e-6) -> nnx.Module:
    """GQA or MLA, as the config says; both map x [B, S, D] -> [B, S, D]."""
    if cfg.kind == "mla":
        from maxmoe.model.mla import LatentAttention

        return LatentAttention(cfg, dim, std=std, dtype=dtype, rngs=rngs)
    return Attention(cfg, dim, std=std, dtype=dtype, rngs=rngs, norm_eps=norm_eps)
