"""Small building blocks: params with logical axes, RMSNorm, embedding, SwiGLU MLP (RoPE: rope.py).

Dimension legend (all model files): B batch, S seq, D embed, H heads, G query heads per kv
head, K experts per token, E experts, F expert mlp, V vocab, L layers, T key positions,
Dh head dim, R rotary dims, C kv latent (kv_lora_rank), Q query latent (q_lora_rank).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from maxmoe.kernels.fp8 import project
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
        return rms_norm(x, self.scale[...], self.eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """scale * x / sqrt(mean(x^2) + eps) over the last axis, statistics in float32 whatever
    the compute dtype (precision policy); returns x's dtype.

    The backward keeps x and the [..., 1] reciprocal RMS and recomputes x / rms from them:
    autodiff kept the normalised x as well, one more [B, S, D] float32 residual per norm that
    the layer scan stacks."""
    return _rms_norm_fwd(x, scale, eps)[0]


def _rms_norm_fwd(x, scale, eps):
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (scale * (x32 * r)).astype(x.dtype), (x, r, scale)


def _rms_norm_bwd(eps, res, g):
    x, r, scale = res
    xn, g = x.astype(jnp.float32) * r, g.astype(jnp.float32)
    gs = g * scale
    dx = r * (gs - xn * jnp.mean(gs * xn, axis=-1, keepdims=True))
    dscale = jnp.sum(g * xn, axis=tuple(range(x.ndim - 1)))
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


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

    def __init__(self, dim: int, hidden: int, *, std: float, dtype, rngs: nnx.Rngs,
                 fp8: str = "none"):
        self.gate = param(rngs, (dim, hidden), ("embed", "mlp"), std)
        self.up = param(rngs, (dim, hidden), ("embed", "mlp"), std)
        self.down = param(rngs, (hidden, dim), ("mlp", "embed"), std)
        self.dtype, self.fp8 = dtype, fp8  # fp8: precision.fp8 (kernels/fp8.py)

    def __call__(self, x: jax.Array) -> jax.Array:
        c = lambda p: p[...].astype(self.dtype)  # noqa: E731
        h = jax.nn.silu(project(x, c(self.gate), self.fp8)) * project(x, c(self.up), self.fp8)
        h = shard(h, ("batch", "seq", "act_mlp"))
        return shard(project(h, c(self.down), self.fp8), ("batch", "seq", "act_embed"))
