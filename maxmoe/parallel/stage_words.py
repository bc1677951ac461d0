"""The pipeline's 16-bit activations as 32-bit words of their bytes, where XLA would otherwise
widen them to float32: the stage inputs the scan saves per iteration for the backward (`pack`,
`unpack`) and the output rows' reduction over the stage axis after the loop (`stage_zero`).
Used by parallel/pipeline.py for bf16 / float16 activations of even width (`packs`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def packs(x: jax.Array) -> bool:
    """Whether x's rows travel as words: a 16-bit float of even width."""
    return jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2 and x.shape[-1] % 2 == 0


def _words(h: jax.Array, word=jnp.float32) -> jax.Array:
    """16-bit floats [..., D] -> `word` (a 32-bit type) [..., D/2] holding the same bytes."""
    return jax.lax.bitcast_convert_type(h.reshape(*h.shape[:-1], -1, 2), word)


def _halves(w: jax.Array, dtype) -> jax.Array:
    """`_words`' inverse: 32-bit words [..., D/2] -> `dtype` [..., D]."""
    return jax.lax.bitcast_convert_type(w, dtype).reshape(*w.shape[:-1], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def pack(h: jax.Array, dtype) -> jax.Array:
    """The stage input h (bf16 [..., D]) as float32 words [..., D/2] of its bytes, the form
    the scan saves per iteration for the backward; `unpack` reads it back, and cotangents
    cross both packed the same way. Saved as bf16, XLA:CPU's float normalisation upcasts the
    saved stack's per-iteration update and read to float32 and hoists the read's conversion
    out of the backward loop: a float32 copy and a second bf16 copy of the whole stack
    (docs/performance/parallelism.md, "Stage inputs and stacks"); float32 words are moved as they
    are."""
    return _words(h)


pack.defvjp(lambda h, dtype: (_words(h), None), lambda dtype, _, g: (_halves(g, dtype),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def unpack(w: jax.Array, dtype) -> jax.Array:
    """`pack`'s inverse: float32 words [..., D/2] -> `dtype` [..., D]."""
    return _halves(w, dtype)


unpack.defvjp(lambda w, dtype: (_halves(w, dtype), None), lambda dtype, _, g: (_words(g),))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def stage_zero(stages: int, io: jax.Array) -> jax.Array:
    """io [P = stages, ...] (16-bit floats, even last dim) -> io[0] on every stage, as a sum
    over the stage axis of the other stages' zeros, in int32 words: the sum is exact and
    XLA:GPU moves it as it is, where a 16-bit float sum runs and reduce-scatters across hosts
    in float32 (twice the bytes; at 671B a 13 GB float32 buffer). Its gradient, the cotangent
    on stage 0 and zeros elsewhere, is the float sum's."""
    words = _words(io, jnp.int32)
    first = (jnp.arange(stages) == 0).reshape(-1, *(1,) * (words.ndim - 1))
    return _halves(jnp.sum(jnp.where(first, words, 0), axis=0), io.dtype)


def _stage_zero_bwd(stages: int, _, g):
    first = (jnp.arange(stages) == 0).reshape(-1, *(1,) * g.ndim)
    return (jnp.where(first, g[None], jnp.zeros((), g.dtype)),)


stage_zero.defvjp(lambda stages, io: (stage_zero(stages, io), None), _stage_zero_bwd)
