"""Routed-expert computation: dropless grouped matmul, expert-parallel over the mesh.

Inside `shard_map` every device holds its batch shard of tokens and E/ep of the experts.
Tokens are all-gathered over the expert axis, each device runs its own experts on the tokens
routed to them (sorted by expert, `lax.ragged_dot`, nothing dropped), and the partial outputs
are reduce-scattered back to the token owners. This all-gather/reduce-scatter form needs no
ragged all-to-all (absent on XLA:CPU) and is the cheaper one for small expert axes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxmoe.sharding import current_mesh, mesh_axes


def local_experts(x, expert_idx, weights, w_gate, w_up, w_down, first_expert):
    """Runs experts [first_expert, first_expert + El) on the tokens routed to them.

    x [T, D]; expert_idx, weights [T, K] (global expert ids); w_gate, w_up [El, D, F];
    w_down [El, F, D]. Returns [T, D] float32: the weighted sum over this shard's experts.
    """
    t, k = expert_idx.shape
    num_local = w_gate.shape[0]
    local = expert_idx.reshape(-1) - first_expert  # [T*K]
    key = jnp.where((local >= 0) & (local < num_local), local, num_local)  # others last
    order = jnp.argsort(key, stable=True)
    token = order // k
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
    xs = x[token]  # [T*K, D] sorted by expert; rows past sum(group_sizes) give zeros
    h = jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, group_sizes)) * jax.lax.ragged_dot(
        xs, w_up, group_sizes)
    out = jax.lax.ragged_dot(h, w_down, group_sizes).astype(jnp.float32)
    out = out * weights.reshape(-1)[order][:, None].astype(jnp.float32)
    # K contributions per token are summed in float32 before the cast back
    return jnp.zeros(x.shape, jnp.float32).at[token].add(out)


def routed_experts(x, expert_idx, weights, w_gate, w_up, w_down):
    """x [B, S, D]; expert_idx, weights [B, S, K]; expert weights [E, D, F] / [E, F, D].

    Returns [B, S, D] in x.dtype. Without a mesh it is the plain single-device computation.
    """
    if current_mesh() is None:
        b, s, d = x.shape
        y = local_experts(x.reshape(-1, d), expert_idx.reshape(b * s, -1),
                          weights.reshape(b * s, -1), w_gate, w_up, w_down, 0)
        return y.astype(x.dtype).reshape(b, s, d)

    batch, ep, tp = mesh_axes("batch"), mesh_axes("experts"), mesh_axes("expert_mlp")
    gathered = tuple(a for a in ep if a in batch)  # tokens of these shards meet the experts
    replicated = tuple(a for a in ep if a not in batch)  # tokens already present everywhere
    tok = P(batch or None, None, None)
    wspec_in = P(ep or None, None, tp or None)
    wspec_out = P(ep or None, tp or None, None)

    @functools.partial(jax.shard_map, in_specs=(tok, tok, tok, wspec_in, wspec_in, wspec_out),
                       out_specs=tok)
    def body(x, idx, w, wg, wu, wd):
        b, s, d = x.shape
        xf, idx, w = x.reshape(-1, d), idx.reshape(b * s, -1), w.reshape(b * s, -1)
        if gathered:
            xf, idx, w = (jax.lax.all_gather(a, gathered, axis=0, tiled=True) for a in (xf, idx, w))
        first = jax.lax.axis_index(ep) * wg.shape[0] if ep else 0
        y = local_experts(xf, idx, w, wg, wu, wd, first)
        if gathered:
            y = jax.lax.psum_scatter(y, gathered, scatter_dimension=0, tiled=True)
        if replicated + tp:
            y = jax.lax.psum(y, replicated + tp)
        return y.astype(x.dtype).reshape(b, s, d)

    return body(x, expert_idx, weights, w_gate, w_up, w_down)
