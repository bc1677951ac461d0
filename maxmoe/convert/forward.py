"""One forward pass of a checkpoint on one device: the check of a conversion (`maxmoe forward`,
maxmoe/commands/forward.py, runs it).

Computed in float32 unless told otherwise (bfloat16 flips experts at routing boundaries).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxmoe.convert.checkpoint_io import load_converted
from maxmoe.model.transformer import build_model


def forward_logits(ckpt_dir, ids, dtype: str = "float32"):
    """ids [B, S] int -> logits [B, S, V] float32 numpy, with the checkpoint in `ckpt_dir` (a
    'convert from-hf' output or a training run directory) computed in `dtype`."""
    cfg, params, _, _ = load_converted(Path(ckpt_dir))
    cfg = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, compute_dtype=dtype))
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: build_model(cfg, 0)))
    model = nnx.merge(graphdef, params)
    ids = jnp.asarray(ids, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)

    @jax.jit
    def run(model, ids, positions):
        return model(ids, jnp.ones_like(ids), positions)[0]

    return np.asarray(run(model, ids, positions), np.float32)
