"""The MoE MLP at a decode step (Block.extend, transformer.py): the chosen experts' weights
gathered, not every expert run.

A decode step has a few tokens, so its B*S*K (token, expert) assignments touch at most that
many of the E experts. The grouped-matmul kernels (parallel/experts.py) read or loop over all
E experts' weights; gathering the K chosen experts of each token reads K of them. Routing is
MoE.route, as in MoE.__call__ (the selection bias included), so the same experts and weights
result; only the order of the float sums differs. Used while B*S*K <= E on an unsplit expert
axis; otherwise (prefill, experts split over devices) the training path runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxmoe.model.moe import MoE
from maxmoe.sharding import mesh_axes, shard


def moe_step(mlp: MoE, x: jax.Array) -> jax.Array:
    """x [B, S, D] -> the MoE output [B, S, D] (no aux), as mlp(x)[0]."""
    b, s, d = x.shape
    k = mlp.cfg.experts_per_token
    if mesh_axes("experts") or b * s * k > mlp.cfg.num_experts:
        return mlp(x)[0]
    idx, weights, _ = mlp.route(x)
    idx, weights = idx.reshape(b * s, k), weights.reshape(b * s, k)

    def chosen(w):  # [E, ...] -> [T, K, ...]: gathered first, then cast (K experts, not E)
        return w[...][idx].astype(mlp.dtype)

    xt = x.reshape(b * s, d)
    h = (jax.nn.silu(jnp.einsum("td,tkdf->tkf", xt, chosen(mlp.gate)))
         * jnp.einsum("td,tkdf->tkf", xt, chosen(mlp.up)))
    h = h * weights[..., None].astype(h.dtype)
    y = jnp.einsum("tkf,tkfd->td", h, chosen(mlp.down), preferred_element_type=jnp.float32)
    y = y.astype(x.dtype).reshape(b, s, d)
    if mlp.shared is not None:
        y = y + mlp.shared(x)
    return shard(y, ("batch", "seq", "act_embed"))
