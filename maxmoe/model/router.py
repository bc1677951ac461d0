"""Top-k expert routing (float32): softmax (Mixtral, Qwen3, DeepSeek-V2) or DeepSeek-V3 sigmoid
scores, optionally group-limited, the sigmoid one with an auxiliary-loss-free selection bias;
the balance losses.

The selection bias is a `RouterBias` variable, not an `nnx.Param`: the optimizer never sees it.
`Transformer.update_router_bias` moves it once per optimizer step from the expert load
(DeepSeek-V3 2.1.2): b_e += speed * sign(mean load - load_e).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from maxmoe.config import MoEConfig
from maxmoe.sharding import current_mesh, mesh_axes


class RouterBias(nnx.Variable):
    """Per-expert selection bias [E]: non-trainable state, updated outside the optimizer."""


def local_top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k over the last axis, computed where each token is (a shard_map over the
    batch axes). XLA's SPMD partitioner does not split a sort by batch: it gathered the whole
    global batch's scores onto every device (4 x [2048, 4096, 256] float32 in the 671B plan)."""
    mesh = current_mesh()
    batch = mesh_axes("batch") if mesh is not None else ()
    if not batch or x.shape[0] % math.prod(mesh.shape[a] for a in batch):
        return jax.lax.top_k(x, k)
    rows = P(batch, *([None] * (x.ndim - 1)))
    # check_vma off as in parallel/experts.py: under the pipeline's vmap the inference misfires
    return jax.shard_map(lambda a: tuple(jax.lax.top_k(a, k)), in_specs=rows, out_specs=(rows, rows),
                         check_vma=False)(x)


def group_limited_choice(choice: jax.Array, cfg: MoEConfig) -> jax.Array:
    """choice [..., E] -> same, with -inf outside each token's best `groups_per_token` groups.

    Groups are ranked as the published models rank them: with sigmoid scores by the sum of the
    two highest biased scores in each (DeepSeek-V3 n_group / topk_group, topk_method noaux_tc),
    with softmax scores by the highest score in each (DeepSeek-V2 topk_method
    group_limited_greedy, modeling_deepseek_v2.py DeepseekV2TopkRouter.forward).
    """
    *lead, e = choice.shape
    grouped = choice.reshape(*lead, cfg.num_groups, e // cfg.num_groups)
    if cfg.router == "sigmoid":
        group_score = jnp.sum(local_top_k(grouped, 2)[0], axis=-1)  # [..., groups]
    else:
        group_score = jnp.max(grouped, axis=-1)
    _, best = local_top_k(group_score, cfg.groups_per_token)
    keep = jnp.any(jax.nn.one_hot(best, cfg.num_groups, dtype=jnp.bool_), axis=-2)  # [..., groups]
    return jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)


def route(logits: jax.Array, cfg: MoEConfig, bias: jax.Array | None = None):
    """logits [B, S, E] float32 -> (expert_idx [B, S, K], weights [B, S, K] float32, aux dict).

    aux: expert_load [E] ((token, k) slots per expert) and router_affinity [E] (mean affinity
    over the tokens): the Switch balance loss's two factors, see `switch_balance_loss`;
    sequence_balance_loss (DeepSeek-V3, mean over rows), z_loss (mean over tokens),
    router_entropy (mean over tokens of the entropy of the affinity distribution, nats: log E
    for a uniform router, 0 for one that puts all weight on one expert) and expert_idx.

    Every entry decomposes over groups of rows of equal size: a sum (load) or a mean of per-row
    or per-token terms (the rest). So a pipelined step, which sums load and averages the rest
    over its microbatches, gets exactly the values of the whole batch.
    """
    if cfg.router == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        affinity = scores / jnp.sum(scores, axis=-1, keepdims=True)  # normalised for the losses
    else:
        scores = affinity = jax.nn.softmax(logits, axis=-1)
    # bias picks experts but does not weight them (DeepSeek-V3 2.1.2)
    choice = scores if bias is None else scores + bias
    if cfg.num_groups > 1:
        choice = group_limited_choice(choice, cfg)
    _, idx = local_top_k(choice, cfg.experts_per_token)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.normalize_top_k:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor

    num_experts = logits.shape[-1]
    hits = jnp.sum(jax.nn.one_hot(idx, num_experts, dtype=jnp.float32), axis=-2)  # [B, S, E]
    load = jnp.sum(hits, axis=(0, 1))
    row_fraction = jnp.mean(hits, axis=1) / cfg.experts_per_token  # [B, E]
    sequence_balance = num_experts * jnp.mean(jnp.sum(row_fraction * jnp.mean(affinity, axis=1), -1))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))  # ST-MoE router z-loss
    entropy = jnp.mean(jnp.sum(jax.scipy.special.entr(affinity), axis=-1))  # entr(0) = 0
    return idx, weights, {"sequence_balance_loss": sequence_balance, "z_loss": z,
                          "expert_load": load, "router_affinity": jnp.mean(affinity, axis=(0, 1)),
                          "router_entropy": entropy, "expert_idx": idx}


def switch_balance_loss(load: jax.Array, affinity: jax.Array) -> jax.Array:
    """The Switch Transformer balance loss E * sum_e f_e P_e of each layer, over the whole
    batch: load [..., E] (token, k) slots per expert (f_e = load_e / sum load), affinity
    [..., E] the mean router affinity over the batch's tokens (P_e). Returns [...].

    Formed from the batch's sums, not per microbatch: a product of two batch means is not the
    mean of per-microbatch products, and formed this way a pipelined step optimises the same
    loss as one device (and as Hugging Face's batch-wide formula). Equals 1 for a uniform
    router; per row it would be DeepSeek-V3's sequence-wise L_bal / alpha."""
    fraction = load / jnp.maximum(jnp.sum(load, axis=-1, keepdims=True), 1.0)
    return load.shape[-1] * jnp.sum(fraction * affinity, axis=-1)


def updated_bias(bias: jax.Array, load: jax.Array, speed: float) -> jax.Array:
    """bias, load [..., E] -> bias moved toward balance: up for under-loaded experts."""
    mean = jnp.mean(load, axis=-1, keepdims=True)
    return bias + speed * jnp.sign(mean - load)
