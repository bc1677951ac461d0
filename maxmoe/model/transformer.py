"""Decoder-only MoE transformer: stacked, scanned, rematerialised blocks and the LM loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from maxmoe.config import AttentionConfig, ModelConfig, MoEConfig
from maxmoe.model.attention import Attention
from maxmoe.model.layers import MLP, Embed, RMSNorm, param
from maxmoe.model.moe import MoE
from maxmoe.sharding import shard

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)); x + mlp(norm(x)); mlp dense or MoE."""

    def __init__(self, model: ModelConfig, attention: AttentionConfig, moe: MoEConfig | None,
                 *, dtype, rngs: nnx.Rngs):
        d, std = model.hidden_size, model.init_std
        self.attn_norm = RMSNorm(d, model.rms_norm_eps)
        self.attn = Attention(attention, d, std=std, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(d, model.rms_norm_eps)
        self.mlp = (MoE(moe, d, std=std, dtype=dtype, rngs=rngs) if moe is not None
                    else MLP(d, model.dense_mlp_size, std=std, dtype=dtype, rngs=rngs))

    def __call__(self, x, segment_ids, positions):
        x = x + self.attn(self.attn_norm(x), segment_ids, positions)
        y = self.mlp(self.mlp_norm(x))
        y, aux = y if isinstance(y, tuple) else (y, {})
        x = shard(x + y, ("batch", "seq", "act_embed"))
        aux["activation_rms"] = jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))
        return x, aux


def _stack(n: int, make, rngs: nnx.Rngs):
    """n blocks with params stacked on a leading layer axis (scanned later)."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r):
        return make(r)
    return build(rngs)


def run_stack(stack, x, segment_ids, positions, *, scan: bool, remat: str):
    """Applies the stacked blocks in order. scan=False unrolls (same params, same math)."""
    graphdef, state = nnx.split(stack)

    def body(h, layer_state):
        return nnx.merge(graphdef, layer_state)(h, segment_ids, positions)

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=not scan)
    if scan:
        return jax.lax.scan(body, x, state)
    n = jax.tree.leaves(state)[0].shape[0]
    auxs = []
    for i in range(n):
        x, aux = body(x, jax.tree.map(lambda a: a[i], state))
        auxs.append(aux)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *auxs)


class Transformer(nnx.Module):
    def __init__(self, model: ModelConfig, attention: AttentionConfig, moe: MoEConfig,
                 *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.cfg, self.moe_cfg = model, moe
        self.embed = Embed(model.vocab_size, model.hidden_size, std=model.init_std, dtype=dtype,
                           rngs=rngs)
        n_dense, n_moe = model.num_dense_layers, model.num_layers - model.num_dense_layers
        self.dense_layers = (_stack(n_dense, lambda r: Block(model, attention, None, dtype=dtype,
                                                             rngs=r), rngs) if n_dense else None)
        self.moe_layers = (_stack(n_moe, lambda r: Block(model, attention, moe, dtype=dtype,
                                                         rngs=r), rngs) if n_moe else None)
        self.final_norm = RMSNorm(model.hidden_size, model.rms_norm_eps)
        self.lm_head = param(rngs, (model.hidden_size, model.vocab_size), ("embed", "vocab"),
                             model.init_std)
        self.dtype = dtype

    def __call__(self, tokens, segment_ids, positions):
        """tokens [B, S] -> (logits [B, S, V] float32, aux stacked per MoE layer)."""
        x = self.embed(tokens)
        run = dict(scan=self.cfg.scan_layers, remat=self.cfg.remat_policy)
        aux: dict = {}
        if self.dense_layers is not None:
            x, dense_aux = run_stack(self.dense_layers, x, segment_ids, positions, **run)
            aux["dense_activation_rms"] = dense_aux["activation_rms"]
        if self.moe_layers is not None:
            x, moe_aux = run_stack(self.moe_layers, x, segment_ids, positions, **run)
            aux.update(moe_aux)
        x = self.final_norm(x)
        logits = jnp.einsum("bsd,dv->bsv", x, self.lm_head[...].astype(self.dtype),
                            preferred_element_type=jnp.float32)
        return shard(logits, ("batch", "seq", "act_vocab")), aux

    def loss(self, batch: dict) -> tuple[jax.Array, dict]:
        """Mean next-token cross-entropy over real targets + MoE auxiliary losses."""
        logits, aux = self(batch["tokens"], batch["segment_ids"], batch["positions"])
        mask = batch["loss_mask"].astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        ce = jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)
        total = ce
        metrics = {"ce_loss": ce}
        if "balance_loss" in aux:
            balance, z = jnp.mean(aux["balance_loss"]), jnp.mean(aux["z_loss"])
            total = total + self.moe_cfg.aux_loss_weight * balance + self.moe_cfg.z_loss_weight * z
            load = aux["expert_load"]  # [L, E] (token, k) slots per expert
            metrics.update(balance_loss=balance, z_loss=z,
                           expert_load_max=jnp.max(load), expert_load_mean=jnp.mean(load),
                           expert_load_min=jnp.min(load))
            metrics["activation_rms"] = aux["activation_rms"]
        metrics["loss"] = total
        return total, metrics
