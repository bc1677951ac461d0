"""The held-out loss is token-weighted: summed cross-entropy over every real target token of
the eval batches / their count, not the mean of per-batch means.

Reference: per-token cross-entropies of the same params' float32 logits in float64 NumPy
(log-softmax), masked and averaged over both batches' loss tokens together. The two batches
hold very different numbers of real tokens (one has padding rows), so the mean of batch means
misses the reference by far more than the tolerance (checked). Tolerance: rtol 1e-6 (float32
sums of a few hundred terms against float64).
"""

import jax
import numpy as np
import pytest
from flax import nnx

import maxmoe.train.evaluate as evaluate
from maxmoe.model.router import RouterBias
from maxmoe.model.transformer import build_model
from maxmoe.sharding import make_mesh, use_mesh
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate
from tests.helpers import random_batch, small_config


def _cut(batch: dict, keep: list[int]) -> dict:
    """batch with row r's real tokens cut to keep[r] (0: a padding row)."""
    batch = {k: v.copy() for k, v in batch.items()}
    for r, n in enumerate(keep):
        for key in ("segment_ids", "targets", "loss_mask", "positions", "tokens"):
            batch[key][r, n:] = 0
    return batch


def _per_token_ce(logits_fn, batch) -> tuple[np.ndarray, np.ndarray]:
    """(per-position CE float64 [B, S], loss mask [B, S]) from the model's float32 logits."""
    logits = np.asarray(logits_fn(batch["tokens"], batch["segment_ids"], batch["positions"]),
                        np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    ce = -np.take_along_axis(log_probs, batch["targets"][..., None], -1)[..., 0]
    return ce, batch["loss_mask"].astype(np.float64)


def test_eval_loss_is_token_weighted(monkeypatch):
    cfg, origins = small_config("mesh.data=2")
    mesh = make_mesh(validate(cfg, 2, origins), jax.devices()[:2])
    trainer = make_trainer(cfg, mesh)
    b = cfg.data.global_batch_size
    full = random_batch(cfg, seed=3)  # every row ~30 loss tokens
    sparse = _cut(random_batch(cfg, seed=4), [0] * (b // 2) + [5] * (b // 2))  # padding rows
    batches = [full, sparse]
    monkeypatch.setattr(evaluate, "make_dataset", lambda *a, **k: iter(batches))
    with use_mesh(mesh, cfg.mesh.rules):
        _, params, buffers = nnx.split(build_model(cfg, cfg.train.seed), nnx.Param, RouterBias)
        state = {"params": params, "buffers": buffers}  # what Evaluator reads of a train state
        result = evaluate.Evaluator(cfg, trainer, tokenizer=None)(state)
        logits_fn = jax.jit(lambda *a: nnx.merge(trainer.graphdef, params, buffers)(*a)[0])
        parts = [_per_token_ce(logits_fn, x) for x in batches]

    total = sum(float((ce * m).sum()) for ce, m in parts)
    count = sum(float(m.sum()) for _, m in parts)
    reference = total / count
    batch_means = np.mean([(ce * m).sum() / m.sum() for ce, m in parts])
    assert abs(batch_means - reference) > 1e-3 * reference  # the test can tell them apart
    assert result.batches == 2 and result.loss_tokens == count
    assert result.loss == pytest.approx(reference, rel=1e-6)
