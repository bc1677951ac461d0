"""Multi-token prediction (DeepSeek-V3 2.2): depth k predicts token i+k+1 from the depth k-1
hidden state at i and the embedding of token i+k, through one extra transformer block.

    h_k = Block(proj([norm(embed(t[i+k])); norm(h_{k-1}[i])]));  logits_k = head(norm(h_k))

The embedding and output head are the main model's (shared, as in the paper).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxmoe.model.layers import RMSNorm, param


class MTPLayer(nnx.Module):
    def __init__(self, block: nnx.Module, dim: int, eps: float, *, std: float, dtype,
                 rngs: nnx.Rngs):
        self.embed_norm = RMSNorm(dim, eps)  # HF hub name: enorm
        self.hidden_norm = RMSNorm(dim, eps)  # hnorm
        self.projection = param(rngs, (2 * dim, dim), (None, "embed"), std)  # eh_proj
        self.block = block
        self.final_norm = RMSNorm(dim, eps)  # shared_head.norm
        self.dtype = dtype

    def __call__(self, hidden: jax.Array, next_embeddings: jax.Array, segment_ids: jax.Array,
                 positions: jax.Array) -> tuple[jax.Array, dict]:
        """hidden, next_embeddings [B, S, D] -> (hidden of this depth [B, S, D], block aux)."""
        joined = jnp.concatenate([self.embed_norm(next_embeddings), self.hidden_norm(hidden)], -1)
        return self.block(joined @ self.projection[...].astype(self.dtype), segment_ids, positions)


def shift_left(x: jax.Array, k: int, fill=0) -> jax.Array:
    """[B, S, ...] -> x[:, i + k] at i, `fill` past the end."""
    pad = jnp.full((x.shape[0], k, *x.shape[2:]), fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)
