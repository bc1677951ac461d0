"""Choosing the next token from logits: greedy, or sampling with a temperature and top-p."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy (argmax); > 0 divides the logits before sampling
    top_p: float = 1.0  # nucleus: sample among the most likely tokens whose mass reaches this
    seed: int = 0  # the sampling key's seed (step i uses fold_in(key, i))


def top_p_filter(logits: jax.Array, top_p: float) -> jax.Array:
    """logits [B, V] -> the same with every token outside the nucleus set to -inf: the
    smallest set of most likely tokens whose probability reaches top_p (the most likely token
    is always kept; tokens tied with the least likely kept one are kept too)."""
    probs = jax.nn.softmax(logits, axis=-1)
    ordered = -jnp.sort(-probs, axis=-1)  # descending
    kept = jnp.cumsum(ordered, axis=-1) - ordered < top_p
    threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(probs >= threshold, logits, -jnp.inf)


def choose(logits: jax.Array, sampling: Sampling, key: jax.Array) -> jax.Array:
    """logits [B, V] float32 -> next tokens [B] int32: argmax (the first of ties, as torch's)
    at temperature 0, else a draw from softmax(logits / temperature) within top_p."""
    if sampling.temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / sampling.temperature
    if sampling.top_p < 1.0:
        scaled = top_p_filter(scaled, sampling.top_p)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
