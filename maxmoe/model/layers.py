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
from jax.sharding import PartitionSpec as P

from maxmoe.kernels.fp8 import project
from maxmoe.sharding import current_mesh, entry_axes, shard, spec


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str | None, ...], std: float) -> nnx.Param:
    """A float32 master weight, normal(0, std), tagged with its logical axes for sharding."""
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis: str = "act_embed"):
        # read in float32 (rms_norm): a bf16 compute copy (mesh.weights zero1) leaves it be
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), axes=(axis,), compute_float32=True)
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
        """tokens [B, S] int -> [B, S, D] in the compute dtype (sharded_lookup)."""
        x = sharded_lookup(self.embedding[...], tokens, self.dtype)
        return shard(x, ("batch", "seq", "act_embed"))


def sharded_lookup(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    """table[tokens] cast to dtype, the [V, D] table kept split as its ("vocab", "embed")
    rules say, forward and backward: table float32 [V, D]; tokens [B, S] int -> [B, S, D].

    Why: left to GSPMD the gather replicated the table, and its scatter-add gradient, as whole
    float32 [V, D] buffers on every device (3.45 GiB each at DeepSeek-V3's 129280 x 7168).
    Inside shard_map each device gathers the token ids of its vocab and embed groups (ints),
    looks them up in its own [V / nv, D / ne] block (zero where the id is another vocab
    shard's), reduce-scatters over the vocab axes and all-to-alls the embed slices back into
    whole rows of its own tokens; the transpose is the same moves reversed and a scatter-add
    into the local block. No mesh (or one device): a plain take."""
    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        return jnp.take(table, tokens, axis=0).astype(dtype)
    table_spec = spec(("vocab", "embed"), shape=table.shape)
    vocab, embed = (entry_axes(e) for e in table_spec)
    tok_spec = spec(("batch", "seq"), shape=tokens.shape)

    @functools.partial(jax.shard_map, in_specs=(table_spec, tok_spec),
                       out_specs=P(*tok_spec, None), check_vma=False)
    def body(block, ids):
        if vocab + embed:  # [nv ne b, s]: every token of the groups, vocab-major
            ids = jax.lax.all_gather(ids, vocab + embed, axis=0, tiled=True)
        rows = block.shape[0]
        local = ids - (jax.lax.axis_index(vocab) * rows if vocab else 0)
        hit = (local >= 0) & (local < rows)
        x = jnp.take(block, jnp.clip(local, 0, rows - 1), axis=0).astype(dtype)
        x = jnp.where(hit[..., None], x, jnp.zeros((), dtype))  # [nv ne b, s, D / ne]
        if vocab:  # sum the vocab shards' parts, each keeps its own group's rows
            x = jax.lax.psum_scatter(x, vocab, scatter_dimension=0, tiled=True)
        if embed:  # [ne b, s, D / ne] -> this device's rows, all D columns
            x = jax.lax.all_to_all(x, embed, 0, 2, tiled=True)
        return x
    return body(table, tokens)


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
