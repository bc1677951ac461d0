"""Mixture-of-Experts MLP: softmax top-k router, stacked routed experts, shared experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from maxmoe.config import MoEConfig
from maxmoe.model.layers import MLP, param
from maxmoe.parallel.experts import routed_experts
from maxmoe.sharding import shard


def route(logits: jax.Array, cfg: MoEConfig):
    """logits [T, E] float32 -> (expert_idx [T, K], weights [T, K], aux dict)."""
    probs = jax.nn.softmax(logits, axis=-1)
    weights, idx = jax.lax.top_k(probs, cfg.experts_per_token)
    if cfg.normalize_top_k:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    num_experts = logits.shape[-1]
    # tokens per expert over all (token, k) slots; also drives the balance loss
    load = jnp.zeros((num_experts,), jnp.float32).at[idx.reshape(-1)].add(1.0)
    fraction = load / idx.size
    # Switch/GShard balance loss: E * sum_e f_e * P_e, equals 1 for a uniform router
    balance = num_experts * jnp.sum(fraction * jnp.mean(probs, axis=0))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))  # ST-MoE router z-loss
    return idx, weights, {"balance_loss": balance, "z_loss": z, "expert_load": load}


class MoE(nnx.Module):
    def __init__(self, cfg: MoEConfig, dim: int, *, std: float, dtype, rngs: nnx.Rngs):
        e, f = cfg.num_experts, cfg.expert_mlp_size
        self.router = param(rngs, (dim, e), ("embed", None), std)
        self.gate = param(rngs, (e, dim, f), ("experts", "embed", "expert_mlp"), std)
        self.up = param(rngs, (e, dim, f), ("experts", "embed", "expert_mlp"), std)
        self.down = param(rngs, (e, f, dim), ("experts", "expert_mlp", "embed"), std)
        self.shared = (MLP(dim, f * cfg.num_shared_experts, std=std, dtype=dtype, rngs=rngs)
                       if cfg.num_shared_experts else None)
        self.cfg, self.dtype = cfg, dtype

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
        """x [B, S, D] -> ([B, S, D], aux losses and expert load)."""
        b, s, d = x.shape
        # router in float32 whatever the compute dtype: top-k flips are costly (precision policy)
        logits = x.astype(jnp.float32) @ self.router[...]
        idx, weights, aux = route(logits.reshape(b * s, -1), self.cfg)
        c = lambda p: p[...].astype(self.dtype)  # noqa: E731
        y = routed_experts(x, shard(idx.reshape(b, s, -1), ("batch", "seq", None)),
                           shard(weights.reshape(b, s, -1), ("batch", "seq", None)),
                           c(self.gate), c(self.up), c(self.down))
        if self.shared is not None:
            y = y + self.shared(x)
        return shard(y, ("batch", "seq", "act_embed")), aux
