"""Decoder-only MoE transformer: embedding, the layer groups in order, LM head and losses.

The layer groups (model/block.py) run in order, so first-k-dense (DeepSeek), every-Nth-MoE and
explicit dense layers (Qwen3) all keep compile time flat in depth. `build_model` and
`abstract_params` are how the rest of the package gets a model or its parameter shapes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from maxmoe.config import AttentionConfig, Config, ModelConfig, MoEConfig
from maxmoe.kernels.lm_loss import chunked_lm_loss, cross_entropy, lm_head_matmul
from maxmoe.model.block import Block, maybe_remat, run_stack, stacked_blocks
from maxmoe.model.layers import Embed, RMSNorm, param, rms_norm
from maxmoe.model.moe import MoE
from maxmoe.model.mtp import MTPLayer, shift_left
from maxmoe.model.router import switch_balance_loss, updated_bias
from maxmoe.model.spec import layer_groups
from maxmoe.parallel.pipeline import num_stages
from maxmoe.parallel.replicas import on_outer_replicas
from maxmoe.parallel.row_groups import over_row_groups
from maxmoe.parallel.schedule import pipeline_schedule
from maxmoe.sharding import shard

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


class LossShare(NamedTuple):
    """How one microbatch's losses count toward its optimizer step's (gradient accumulation).

    Each cross-entropy is divided by the whole step's loss tokens rather than its own, which
    weights the microbatch's mean by n_m / N: the microbatches' losses then sum to the loss of
    the whole batch. The router losses are means over positions (padding included) or rows;
    every microbatch has the same number of both, so each counts 1 / microbatches."""
    step_tokens: jax.Array  # [1 + mtp_depth] float32, loss_token_counts of the whole step
    microbatches: int


def mtp_mask(batch: dict, k: int) -> jax.Array:
    """[B, S] float32: 1 where MTP depth k has a target at position i (token i+k+1 is a loss
    token and lies in the same packed document as position i)."""
    same_doc = shift_left(batch["segment_ids"], k, fill=-1) == batch["segment_ids"]
    return shift_left(batch["loss_mask"].astype(jnp.float32), k) * same_doc


def loss_token_counts(batch: dict, mtp_depth: int) -> jax.Array:
    """[1 + mtp_depth] float32: the loss tokens of `batch` for the main cross-entropy, then
    for each MTP depth k = 1..mtp_depth (the denominators of their means)."""
    masks = [batch["loss_mask"].astype(jnp.float32)]
    masks += [mtp_mask(batch, k) for k in range(1, mtp_depth + 1)]
    return jnp.stack([jnp.sum(m) for m in masks])


def _nothing_summed(out, aux):
    """(out, aux) -> over_row_groups' (out, summed, aux) with nothing summed."""
    return out, (), aux



def _join(auxs: list[dict], key: str):
    return jnp.concatenate([a[key] for a in auxs if key in a], axis=0)


class Transformer(nnx.Module):
    def __init__(self, model: ModelConfig, attention: AttentionConfig, moe: MoEConfig,
                 *, dtype=jnp.bfloat16, rngs: nnx.Rngs, fp8: str = "none"):
        self.cfg, self.moe_cfg = model, moe
        self.embed = Embed(model.vocab_size, model.hidden_size, std=model.init_std, dtype=dtype,
                           rngs=rngs)

        def block(is_moe: bool, r: nnx.Rngs) -> Block:
            return Block(model, attention, moe if is_moe else None, dtype=dtype, rngs=r, fp8=fp8)

        groups = layer_groups(model)
        # scan_layers=false: each layer's params are its own arrays (checkpoints then hold
        # layer_groups/<group>/<layer>/...; the scanned layout is layer_groups/<group>/...[L])
        self.layer_groups = nnx.List([
            stacked_blocks(n, lambda r, m=is_moe: block(m, r), rngs, per_layer=not model.scan_layers)
            for is_moe, _, n in groups])
        self.final_norm = RMSNorm(model.hidden_size, model.rms_norm_eps)
        self.lm_head = param(rngs, (model.hidden_size, model.vocab_size), ("embed", "vocab"),
                             model.init_std)
        # MTP blocks are of the kind of the last layer (MoE in DeepSeek-V3)
        last_is_moe = groups[-1][0]
        self.mtp = nnx.List([
            MTPLayer(block(last_is_moe, rngs), model.hidden_size, model.rms_norm_eps,
                     std=model.init_std, dtype=dtype, rngs=rngs)
            for _ in range(model.mtp_depth)]) if model.mtp_depth else None
        self.dtype = dtype

    def hidden(self, tokens, segment_ids, positions):
        """tokens [B, S] -> (last hidden state [B, S, D] before the final norm, aux).

        aux: MoE entries stacked over MoE layers in order ([L_moe] or [L_moe, ...]),
        dense_activation_rms over dense layers.
        """
        with jax.named_scope("embed"):
            x = self.embed(tokens)
        moe_auxs, dense_auxs = [], []
        schedule = pipeline_schedule(self.cfg, num_stages())
        groups = self.cfg.outer_microbatches
        for (is_moe, _, n), stack in zip(layer_groups(self.cfg), self.layer_groups, strict=True):
            run = functools.partial(run_stack, stack, remat=self.cfg.remat_policy,
                                    pipeline=schedule if schedule.pipelines(n) else None)
            if groups > 1 and not schedule.pipelines(n):  # outside the pipeline: row groups
                x, _, group_aux = over_row_groups(lambda *rows, run=run: _nothing_summed(
                    *run(*rows)), groups, (x, segment_ids, positions), ())
            else:
                x, group_aux = run(x, segment_ids, positions)
            (moe_auxs if is_moe else dense_auxs).append(group_aux)
        aux: dict = {}
        if dense_auxs:
            aux["dense_activation_rms"] = _join(dense_auxs, "activation_rms")
        if moe_auxs:
            aux.update({k: _join(moe_auxs, k) for k in moe_auxs[0]})
        return x, aux

    def head_weight(self, head: jax.Array | None = None) -> jax.Array:
        """The LM head [D, V] (`head`, default the model's) in the compute dtype, cast where
        it is still split by its ("embed", "vocab") rules: whatever gathers it for the matmul
        then moves and holds the compute dtype, not a float32 [D, V] copy."""
        head = self.lm_head[...] if head is None else head
        return shard(shard(head, ("embed", "vocab")).astype(self.dtype), ("embed", "vocab"))

    def logits(self, x: jax.Array, norm: RMSNorm | None = None) -> jax.Array:
        """x [B, S, D] -> logits [B, S, V] float32 (final norm, then the LM head)."""
        with jax.named_scope("lm_head"):
            x = (norm or self.final_norm)(x)
            logits = lm_head_matmul(x, self.head_weight())
            return shard(logits, ("batch", "seq", "act_vocab"))

    def _lm_loss(self, x, targets, mask, norm: RMSNorm | None = None,
                 tokens: jax.Array | None = None) -> jax.Array:
        """Cross-entropy of the LM head on x [B, S, D] summed over the real targets (mask),
        divided by `tokens` (default: their count); model.lm_loss_chunk > 0 runs head and loss
        chunk by chunk (kernels/lm_loss.py). Run on the compute copy's replicas of the head
        and norm where it holds them (replicas.on_outer_replicas: their gradients are then
        reduced once per step, not once per row group)."""
        norm, chunk = norm or self.final_norm, self.cfg.lm_loss_chunk

        def summed(weights, x, targets, mask):  # the CE summed over these rows' real targets
            head, scale = weights
            with jax.named_scope("lm_head"):
                h = rms_norm(x, scale, norm.eps)
                if chunk:
                    return chunked_lm_loss(h, self.head_weight(head), targets, mask, chunk)
                logits = shard(lm_head_matmul(h, self.head_weight(head)),
                               ("batch", "seq", "act_vocab"))
            return cross_entropy(logits, targets, mask, 1.0)

        total = on_outer_replicas(summed, (self.lm_head[...], norm.scale[...]), x, targets,
                                  mask)
        return total / jnp.maximum(jnp.sum(mask) if tokens is None else tokens, 1.0)

    def __call__(self, tokens, segment_ids, positions):
        """tokens [B, S] -> (logits [B, S, V] float32, aux stacked per MoE layer)."""
        x, aux = self.hidden(tokens, segment_ids, positions)
        return self.logits(x), aux

    def loss(self, batch: dict, share: LossShare | None = None) -> tuple[jax.Array, dict]:
        """Mean next-token cross-entropy over real targets + MoE auxiliary losses (+ MTP).

        share: this batch is one microbatch of a step (LossShare): the losses and their metrics
        are its weighted part, which summed over the step's microbatches give the whole batch's.
        """
        x, aux = self.hidden(batch["tokens"], batch["segment_ids"], batch["positions"])
        counts = (loss_token_counts(batch, self.cfg.mtp_depth) if share is None
                  else share.step_tokens)
        ce, mtp_losses, mtp_aux = self._outer_losses(x, batch, counts)
        total = ce
        metrics = {"ce_loss": ce}
        if "dense_activation_rms" in aux:  # [L_dense]; MoE layers' RMS follow below
            metrics["dense_activation_rms"] = aux["dense_activation_rms"]
        if self.mtp is not None:
            mtp_loss = jnp.mean(mtp_losses)
            total = total + self.cfg.mtp_loss_weight * mtp_loss
            metrics["mtp_loss"] = mtp_loss
            if "expert_load" in aux and "expert_load" in mtp_aux:
                aux = {k: jnp.concatenate([aux[k], mtp_aux[k]]) for k in aux
                       if k in mtp_aux}
        if "expert_load" in aux:
            # from the step's summed load and mean affinity (router.switch_balance_loss); a
            # gradient-accumulation microbatch adds 1/A of its own (share)
            e, part = self.moe_cfg, 1.0 if share is None else 1.0 / share.microbatches
            balance = jnp.mean(switch_balance_loss(aux["expert_load"],
                                                   aux["router_affinity"])) * part
            z = jnp.mean(aux["z_loss"]) * part
            sequence_balance = jnp.mean(aux["sequence_balance_loss"]) * part
            total = (total + e.aux_loss_weight * balance + e.z_loss_weight * z
                     + e.sequence_balance_loss_weight * sequence_balance)
            load = aux["expert_load"]  # [L, E] (token, k) slots per expert
            metrics.update(balance_loss=balance, z_loss=z, sequence_balance_loss=sequence_balance,
                           expert_load=load, **load_summary(load),
                           dropped_fraction=jnp.mean(aux["dropped_fraction"]) * part,
                           dispatch_rounds=jnp.max(aux["dispatch_rounds"]))
            # per MoE layer [L_moe] (MTP's last): means over this batch's tokens / assignments
            metrics.update(activation_rms=aux["activation_rms"],
                           router_entropy=aux["router_entropy"],
                           dropped_fraction_by_layer=aux["dropped_fraction"])
        metrics["loss"] = total
        return total, metrics

    def _outer_losses(self, x, batch, counts):
        """The LM loss and MTP after the layers: x [B, S, D], counts [1 + D] the denominators
        (loss_token_counts of the whole batch or step) -> (CE, MTP losses per depth [D] or None,
        MTP aux [D, ...]). With model.outer_microbatches = G > 1 over G groups of rows in
        turn (parallel/row_groups.py). What the scan keeps per group stays small: the chunked
        head (model.lm_loss_chunk) keeps only its input and log-sum-exps, the MTP blocks are
        rematerialised as model.remat_policy says; the unchunked head would keep its float32
        logits, so then each group's whole pass is rematerialised (one more forward of it)."""
        groups, chunked = self.cfg.outer_microbatches, self.cfg.lm_loss_chunk > 0
        cols = ("tokens", "targets", "loss_mask", "segment_ids", "positions")

        def one(x, *values):
            part = dict(zip(cols, values, strict=True))
            ce = self._lm_loss(x, part["targets"], part["loss_mask"].astype(jnp.float32),
                               tokens=counts[0])
            if self.mtp is None:
                return None, (ce, None), {}
            losses, aux = self._mtp_losses(x, part, counts[1:], remat=groups > 1 and chunked)
            return None, (ce, losses), aux

        if groups == 1:
            _, (ce, losses), aux = one(x, *(batch[c] for c in cols))
            return ce, losses, aux
        zeros = (jnp.zeros((), jnp.float32),
                 None if self.mtp is None else jnp.zeros((len(self.mtp),), jnp.float32))
        _, (ce, losses), aux = over_row_groups(one, groups, (x, *(batch[c] for c in cols)),
                                               zeros, remat=not chunked)
        return ce, losses, aux

    def _mtp_losses(self, x, batch, step_tokens, remat: bool = False):
        """[D] the CE of predicting token i+k+1 at position i for depths k = 1..D, each
        divided by step_tokens[k - 1], and the MTP blocks' aux [D, ...]. remat: each MTP layer
        under jax.checkpoint with model.remat_policy (inside a scan over row groups, its
        internals would otherwise be kept for every group)."""
        tokens, segment_ids, positions = batch["tokens"], batch["segment_ids"], batch["positions"]
        losses, auxs = [], []
        for k, layer in enumerate(self.mtp, start=1):
            x, aux = maybe_remat(layer, self.cfg.remat_policy if remat else "none")(
                x, self.embed(shift_left(tokens, k)), segment_ids, positions)
            losses.append(self._lm_loss(x, shift_left(batch["targets"], k), mtp_mask(batch, k),
                                        layer.final_norm, step_tokens[k - 1]))
            auxs.append({key: value[None] for key, value in aux.items()})
        joined = {key: _join(auxs, key) for key in auxs[0]}
        return jnp.stack(losses), joined

    def _moe_blocks(self) -> list[MoE]:
        """The MoE MLPs in the order of the [L_moe, ...] metrics: layer groups (a stacked
        group's MoE holds all its layers), then the MTP blocks."""
        blocks = [mlp for stack in self.layer_groups
                  for mlp in ([b.mlp for b in stack] if isinstance(stack, nnx.List)
                              else [stack.mlp])]
        blocks += [layer.block.mlp for layer in (self.mtp or [])]
        return [mlp for mlp in blocks if isinstance(mlp, MoE)]

    def router_bias(self) -> jax.Array | None:
        """The aux-loss-free selection biases [L_moe (+ MTP), E] in metric order; None when
        the routers have none (softmax routing)."""
        biases = [mlp.bias[...] for mlp in self._moe_blocks() if mlp.bias is not None]
        if not biases:
            return None
        return jnp.concatenate([b.reshape(-1, b.shape[-1]) for b in biases])

    def update_router_bias(self, expert_load: jax.Array, speed: float) -> None:
        """In place, once per optimizer step: expert_load [L_moe (+ MTP), E] as in loss metrics."""
        row = 0
        for mlp in self._moe_blocks():
            n = 1 if mlp.bias[...].ndim == 1 else mlp.bias[...].shape[0]
            load = expert_load[row:row + n].reshape(mlp.bias[...].shape)
            mlp.bias[...] = updated_bias(mlp.bias[...], load, speed)
            row += n


def build_model(cfg: Config, seed: int = 0) -> Transformer:
    """The Transformer of cfg's model, attention and MoE sections, computing in
    precision.compute_dtype, its params initialised from `seed`."""
    return Transformer(cfg.model, cfg.attention, cfg.moe,
                       dtype=DTYPES[cfg.precision.compute_dtype], rngs=nnx.Rngs(seed),
                       fp8=cfg.precision.fp8)


def abstract_params(cfg: Config) -> dict:
    """ShapeDtypeStructs of the pure dict of every model variable (params and router bias)."""
    model = nnx.eval_shape(lambda: build_model(cfg, 0))
    return nnx.to_pure_dict(nnx.state(model))


def load_summary(load: jax.Array) -> dict:
    """expert_load [L, E] -> its max and min over all layers (expert_load_max / _min) and
    load_max_mean_ratio_max, the largest max/mean load of any layer (1 when balanced, E / k
    when every token picks the same k experts): the scalar the guard warns on. (The mean load,
    tokens x k / E, is fixed by the batch and was dropped.)"""
    ratio = jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-30)
    return {"expert_load_max": jnp.max(load), "expert_load_min": jnp.min(load),
            "load_max_mean_ratio_max": jnp.max(ratio)}
