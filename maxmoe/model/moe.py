"""Mixture-of-Experts MLP: router (router.py), stacked routed experts, shared experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxmoe.config import MoEConfig
from maxmoe.model.layers import MLP, param
from maxmoe.model.router import RouterBias, route
from maxmoe.parallel.experts import routed_experts
from maxmoe.parallel.replicas import on_sublayer_replicas
from maxmoe.sharding import shard


class MoE(nnx.Module):
    def __init__(self, cfg: MoEConfig, dim: int, *, std: float, dtype, rngs: nnx.Rngs,
                 fp8: str = "none"):
        e, f = cfg.num_experts, cfg.expert_mlp_size
        self.router = param(rngs, (dim, e), ("embed", None), std)
        self.router.set_metadata("compute_float32", True)  # float32 logits (route)
        self.gate = param(rngs, (e, dim, f), ("experts", "embed", "expert_mlp"), std)
        self.up = param(rngs, (e, dim, f), ("experts", "embed", "expert_mlp"), std)
        self.down = param(rngs, (e, f, dim), ("experts", "expert_mlp", "embed"), std)
        self.shared = (MLP(dim, f * cfg.num_shared_experts, std=std, dtype=dtype, rngs=rngs, fp8=fp8)
                       if cfg.num_shared_experts else None)
        # DeepSeek-V3 sigmoid routing selects with scores + bias (aux-loss-free balancing)
        self.bias = (RouterBias(jnp.zeros((e,), jnp.float32), axes=(None,),
                                store_by_rules=True)
                     if cfg.router == "sigmoid" else None)
        self.cfg, self.dtype, self.fp8 = cfg, dtype, fp8  # fp8: precision.fp8

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
        """x [B, S, D] -> (expert idx [B, S, K], combine weights [B, S, K], router aux):
        router.route on float32 logits with the selection bias. The one routing of the train
        (__call__) and decode (decode_moe.moe_step) paths, so both pick the same experts."""
        # router in float32 whatever the compute dtype: top-k flips are costly (precision policy)
        with jax.named_scope("router"):
            logits = x.astype(jnp.float32) @ self.router[...]
            bias = None if self.bias is None else self.bias[...]
            return route(logits, self.cfg, bias)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
        """x [B, S, D] -> ([B, S, D], aux losses, expert load [E] and expert_idx [B, S, K])."""
        # router and shared experts on their expert-group replicas, if any (replicas.py);
        # the routed experts' shard_map outside, on every group's tokens
        (idx, weights), aux = on_sublayer_replicas(
            lambda m, x: (lambda i, w, a: ((i, w), a))(*m.route(x)), self, x)
        # named for the save_named / offload_named remat policies (transformer.py)
        idx, weights = (checkpoint_name(t, "moe_dispatch") for t in (idx, weights))
        c = lambda p: p[...].astype(self.dtype)  # noqa: E731
        y, stats = routed_experts(
            x, shard(idx, ("batch", "seq", None)), shard(weights, ("batch", "seq", None)),
            c(self.gate), c(self.up), c(self.down), self.cfg, fp8=self.fp8)
        aux.update(stats)  # dropped_fraction, dispatch_rounds
        y = checkpoint_name(y, "moe_combine")
        if self.shared is not None:
            with jax.named_scope("shared_experts"):
                y = y + on_sublayer_replicas(lambda m, x: (m.shared(x), None), self, x)[0]
        return shard(y, ("batch", "seq", "act_embed")), aux
