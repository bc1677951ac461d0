"""Small building blocks: params with logical axes, RMSNorm, embedding, SwiGLU MLP (RoPE: rope.py).

Dimension legend (all model files): B batch, S seq, D embed, H heads, G query heads per kv
head, K experts per token, E experts, F expert mlp, V vocab, L layers, T key positions,
Dh head dim, R rotary dims, C kv latent (kv_lora_rank), Q query latent (q_lora_rank).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxmoe.sharding import shard


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float) -> nnx.Param:
    """A float32 master weight, normal(0, std), tagged with its logical axes for sharding."""
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis: str = "act_embed"):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), axes=(axis,))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        # statistics in float32 whatever the compute dtype (precision policy)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.scale[...] * y).astype(x.dtype)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, std: float, dtype, rngs: nnx.Rngs):
        self.embedding = param(rngs, (vocab, dim), ("vocab", "embed"), std)
        self.dtype = dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        # gather from a vocab-replicated table: GSPMD cannot partition a gather over a
        # vocab-sharded table without replicating the output (it warns and remats)
        table = shard(self.embedding[...].astype(self.dtype), (None, "act_embed"))
        x = jnp.take(table, tokens, axis=0)  # [B, S, D]
        return shard(x, ("batch", "seq", "act_embed"))


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, dim: int, hidden: int, *, std: float, dtype, rngs: nnx.Rngs):
        self.gate = param(rngs, (dim, hidden), ("embed", "mlp"), std)
        self.up = param(rngs, (dim, hidden), ("embed", "mlp"), std)
        self.down = param(rngs, (hidden, dim), ("mlp", "embed"), std)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        c = lambda p: p[...].astype(self.dtype)  # noqa: E731
        h = jax.nn.silu(x @ c(self.gate)) * (x @ c(self.up))
        h = shard(h, ("batch", "seq", "act_mlp"))
        return shard(h @ c(self.down), ("batch", "seq", "act_embed"))
