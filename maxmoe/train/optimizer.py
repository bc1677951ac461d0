"""AdamW with linear warmup + cosine decay and scheduled global-norm clipping (optax)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from maxmoe.config import OptimizerConfig
from maxmoe.sharding import path_keys


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    decay = cfg.decay_steps or max(total_steps - cfg.warmup_steps, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.warmup_steps + decay, end_value=cfg.learning_rate * cfg.min_lr_ratio)


def clip_norm_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Constant grad_clip_norm, or a linear decay to grad_clip_end_norm (then held)."""
    if not cfg.grad_clip_end_norm:
        return optax.constant_schedule(cfg.grad_clip_norm)
    return optax.linear_schedule(cfg.grad_clip_norm, cfg.grad_clip_end_norm,
                                 cfg.grad_clip_decay_steps or max(total_steps, 1))


class ClipState(NamedTuple):
    count: jax.Array  # applied updates so far (a skipped step leaves it, like adam's count)


def clip_by_scheduled_global_norm(schedule: optax.Schedule
                                  ) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm with the max norm read from schedule(count).

    update() takes the gradients' global norm as the extra argument `grad_norm` when the
    caller has it: the train step computes it anyway (guards, metrics), and inside the step's
    update branch XLA cannot reuse it, so the clip would read every gradient a second time."""

    def init(params):
        del params
        return ClipState(jnp.zeros((), jnp.int32))

    def update(updates, state, params=None, *, grad_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        max_norm = jnp.asarray(schedule(state.count), norm.dtype)
        # optax.clip_by_global_norm's result to within an ulp, as one scalar factor: a
        # per-element divide is "expensive" to XLA, so the clipped gradient was written out
        # as its own pass over every gradient (XLA:CPU has no multi-output fusion); a multiply
        # by a scalar is folded into the moment updates that read it
        scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        updates = jax.tree.map(lambda t: t * scale.astype(t.dtype), updates)
        return updates, ClipState(optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


def _decay_mask(params):
    # no weight decay on norm scales (1-D per layer); matrices and embeddings decay
    def keep(path, _):
        return not any("norm" in str(k) for k in path_keys(path))
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    parts = ([clip_by_scheduled_global_norm(clip_norm_schedule(cfg, total_steps))]
             if cfg.grad_clip_norm > 0 else [])
    # a bfloat16 first moment halves its memory; the second moment keeps float32 (its range
    # and the sqrt make it the sensitive one)
    parts.append(optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2,
                             eps=cfg.eps, weight_decay=cfg.weight_decay, mask=_decay_mask,
                             mu_dtype=jnp.dtype(cfg.moment_dtype)))
    return optax.chain(*parts)
