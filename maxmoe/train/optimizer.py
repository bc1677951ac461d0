"""AdamW with linear warmup + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax

from maxmoe.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    decay = cfg.decay_steps or max(total_steps - cfg.warmup_steps, 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.warmup_steps + decay, end_value=cfg.learning_rate * cfg.min_lr_ratio)


def _decay_mask(params):
    # no weight decay on norm scales (1-D per layer); matrices and embeddings decay
    def keep(path, _):
        return not any("norm" in str(getattr(k, "key", k)) for k in path)
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    parts = [optax.clip_by_global_norm(cfg.grad_clip_norm)] if cfg.grad_clip_norm > 0 else []
    parts.append(optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2,
                             eps=cfg.eps, weight_decay=cfg.weight_decay, mask=_decay_mask))
    return optax.chain(*parts)
