"""Multi-head latent attention (DeepSeek-V2/V3): low-rank compressed keys/values and queries,
with a decoupled RoPE key of R dims shared by all heads.

    q  = q_b(rms(q_a(x)))  or  q(x)        -> per head (nope [Dn], rope [R])
    c  = rms(kv_a(x)) [C];  k_pe = rope(k_rope(x)) [R], one head for all
    k_nope = c @ k_nope [H, Dn];  v = c @ v [H, Dv]
    softmax scale = (Dn + R)^-0.5 * mscale(factor, mscale_all_dim)^2 under YaRN
"""

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
from maxmoe.model.rope import apply_rope, yarn_mscale
from maxmoe.sharding import shard

# DeepSeek's latent norms use a fixed eps, whatever the model's rms_norm_eps
LATENT_NORM_EPS = 1e-6


def softmax_scale(cfg: AttentionConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling != "none" and cfg.rope_mscale_all_dim:
        # YaRN stretches positions; the extra temperature keeps attention entropy (DeepSeek-V2)
        scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
    return scale


class LatentAttention(nnx.Module):
    def __init__(self, cfg: AttentionConfig, dim: int, *, std: float, dtype, rngs: nnx.Rngs,
                 fp8: str = "none"):
        h, nope, rope, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank:
            self.q_a = param(rngs, (dim, cfg.q_lora_rank), ("embed", "q_lora"), std)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, "q_lora")
            self.q_b = param(rngs, (cfg.q_lora_rank, h, nope + rope), ("q_lora", "heads", "head_dim"), std)
            self.q = None
        else:
            self.q_a = self.q_a_norm = self.q_b = None
            self.q = param(rngs, (dim, h, nope + rope), ("embed", "heads", "head_dim"), std)
        self.kv_a = param(rngs, (dim, cfg.kv_lora_rank), ("embed", "kv_lora"), std)
        self.k_rope = param(rngs, (dim, rope), ("embed", "head_dim"), std)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, "kv_lora")
        self.k_nope = param(rngs, (cfg.kv_lora_rank, h, nope), ("kv_lora", "heads", "head_dim"), std)
        self.v = param(rngs, (cfg.kv_lora_rank, h, dv), ("kv_lora", "heads", "head_dim"), std)
        self.o = param(rngs, (h, dv, dim), ("heads", "head_dim", "embed"), std)
        self.cfg, self.dtype, self.fp8 = cfg, dtype, fp8  # fp8: precision.fp8

    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """x [B, S, D] -> [B, S, D]."""
        cfg = self.cfg
        c = lambda p: p[...].astype(self.dtype)  # noqa: E731
        heads = ("batch", "seq", "act_heads", None)
        with jax.named_scope("projection"):  # the profile's "attention: projections"
            if self.q is not None:
                q = project(x, c(self.q), self.fp8, "bsd,dhk->bshk")
            else:
                q_latent = shard(self.q_a_norm(project(x, c(self.q_a), self.fp8)),  # [B, S, Q]
                                 ("batch", "seq", None))
                q = project(q_latent, c(self.q_b), self.fp8, "bsq,qhk->bshk")
            latent = shard(self.kv_a_norm(project(x, c(self.kv_a), self.fp8)), ("batch", "seq", None))  # [B, T, C]
            k_pe = project(x, c(self.k_rope), self.fp8)[:, :, None, :]
            k_nope = shard(project(latent, c(self.k_nope), self.fp8, "btc,chk->bthk"), heads)
            v = shard(project(latent, c(self.v), self.fp8, "btc,chk->bthk"), heads)
        q = shard(q, heads)
        q_nope, q_pe = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        q_pe = apply_rope(q_pe, positions, cfg)
        k_pe = apply_rope(k_pe, positions, cfg)[:, :, 0]  # [B, T, R]
        # named for the save_named / offload_named remat policies (transformer.py)
        q_nope, q_pe, k_nope, k_pe, v = (checkpoint_name(t, "qkv_proj")
                                         for t in (q_nope, q_pe, k_nope, k_pe, v))
        # one head dim of Dn + R: [q_nope, q_pe] . [k_nope, k_pe] is the sum of the two scores
        # (the RoPE key is broadcast to every head, as Hugging Face's DeepSeek modules do)
        q = jnp.concatenate([q_nope, q_pe], axis=-1)
        k_pe = jnp.broadcast_to(k_pe[:, :, None], (*k_nope.shape[:3], k_pe.shape[-1]))
        k = shard(jnp.concatenate([k_nope, k_pe], axis=-1), heads)
        implementation = resolve_implementation(cfg.implementation, q.dtype)
        tokamax_ops.log_kernel("attention", implementation)
        if implementation in ("fused", "tokamax"):
            run = fused_attention if implementation == "fused" else tokamax_ops.attention
            out = shard(run(q, k, v, segment_ids, softmax_scale(cfg)), heads)
            layout = "bshk,hkd->bsd"
        else:
            q = q * softmax_scale(cfg)
            out = attention_core(q.transpose(0, 2, 1, 3)[:, :, None], k.transpose(0, 2, 1, 3),
                                 v.transpose(0, 2, 1, 3), segment_ids, cfg.causal_block_size)
            out = shard(out[:, :, 0], ("batch", "act_heads", "seq", None))
            layout = "bhsk,hkd->bsd"
        with jax.named_scope("projection"):
            out = shard(project(out, c(self.o), self.fp8, layout), ("batch", "seq", "act_embed"))
        return checkpoint_name(out, "attn_out")

    def extend(self, x, positions, cache, start, kv_valid):
        """Decoding with a KV cache: x [B, S, D] are the tokens of cache slots start..start+S-1
        at positions [B, S]; cache (latent [B, T, C], roped k_pe [B, T, R]); kv_valid [B, T]
        (model/kv_cache.py) -> (out [B, S, D], updated cache).

        k_nope and v are absorbed, never expanded per cached slot: q_nope @ k_nope^T gives a
        query in latent space [B, S, H, C] scored against the cached latent, and the
        attention output stays in latent space until its v projection."""
        cfg = self.cfg
        c = lambda p: p[...].astype(self.dtype)  # noqa: E731
        heads = ("batch", "seq", "act_heads", None)
        if self.q is not None:
            q = jnp.einsum("bsd,dhk->bshk", x, c(self.q))
        else:
            q = jnp.einsum("bsq,qhk->bshk", self.q_a_norm(x @ c(self.q_a)), c(self.q_b))
        q = shard(q, heads)
        length = cache[0].shape[1]
        q_pe = apply_rope(q[..., cfg.qk_nope_head_dim:], positions, cfg, length)
        k_pe = apply_rope((x @ c(self.k_rope))[:, :, None, :], positions, cfg, length)[:, :, 0]
        cache = (kv_cache.write(cache[0], self.kv_a_norm(x @ c(self.kv_a)), start),
                 kv_cache.write(cache[1], k_pe, start))
        q_latent = jnp.einsum("bshk,chk->bshc", q[..., :cfg.qk_nope_head_dim], c(self.k_nope))
        f32 = jnp.float32
        scores = (jnp.einsum("bshc,btc->bhst", q_latent, cache[0], preferred_element_type=f32)
                  + jnp.einsum("bshr,btr->bhst", q_pe, cache[1], preferred_element_type=f32))
        probs = jax.nn.softmax(scores * softmax_scale(cfg)
                               + kv_cache.cache_bias(start, x.shape[1], kv_valid), axis=-1)
        out_latent = jnp.einsum("bhst,btc->bshc", probs.astype(cache[0].dtype), cache[0])
        out = shard(jnp.einsum("bshc,chk->bshk", out_latent, c(self.v)), heads)
        out = jnp.einsum("bshk,hkd->bsd", out, c(self.o))
        return shard(out, ("batch", "seq", "act_embed")), cache
