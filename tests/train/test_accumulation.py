"""Gradient accumulation computes the step of the unsplit batch.

Reference: the same params and batch with train.grad_accum_steps=1 (one device, float32). The
rows hold deliberately unequal numbers of real tokens, so per-microbatch means averaged with
equal weights miss (by 1.4e-3 relative, over the loss check's 1e-5).
Tolerance: loss and metrics rtol 1e-5; every gradient within rtol 1e-4 and atol 1e-6 x the
largest reference gradient of its leaf (only the order of float32 sums differs).

The Switch balance loss is a product of batch means and does not decompose over microbatches,
so moe.aux_loss_weight=0 here; the z-loss (a mean over all positions), DeepSeek's sequence-wise
balance loss (a mean over rows) and MTP (its own loss tokens) stay on: they decompose exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxmoe.config_files import load_config
from maxmoe.model.router import RouterBias
from maxmoe.model.transformer import build_model
from maxmoe.sharding import make_mesh, named, spec, state_shardings, use_mesh
from maxmoe.train.gradients import accumulated, make_gradients
from maxmoe.validation import dcn_sizes, validate
from tests.helpers import random_batch

OVERRIDES = [  # tiny_deepseek_v3 (MLA, sigmoid group routing, MTP), shrunk
    "model.vocab_size=256", "model.hidden_size=64", "model.num_layers=2", "data.seq_len=32",
    "data.global_batch_size=16", "precision.compute_dtype=float32", "mesh.data=-1",
    "mesh.fsdp=1", "mesh.expert=1", "moe.aux_loss_weight=0.0", "moe.z_loss_weight=0.01",
    "moe.sequence_balance_loss_weight=0.01",
]
# loss-like metrics compared with the reference (expert_load: counts, summed; the per-layer
# router_entropy and dropped_fraction_by_layer: means over the step's tokens)
METRICS = ("loss", "ce_loss", "mtp_loss", "z_loss", "sequence_balance_loss", "expert_load",
           "expert_load_max", "expert_load_min", "load_max_mean_ratio_max", "activation_rms",
           "dense_activation_rms", "dropped_fraction", "router_entropy",
           "dropped_fraction_by_layer")


def config(*extra: str):
    return load_config(["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml"],
                       OVERRIDES + list(extra))


def unequal_batch(cfg) -> dict:
    """random_batch with row r cut to a different number of real tokens: even rows (one
    microbatch at 2 microbatches) keep most of theirs, odd rows a few, row 3 none."""
    batch = random_batch(cfg, seed=1)
    s = cfg.data.seq_len
    for r in range(cfg.data.global_batch_size):
        keep = 0 if r == 3 else (s - 2 - r if r % 2 == 0 else 3 + r // 2)
        for key in ("segment_ids", "targets", "loss_mask", "positions", "tokens"):
            batch[key][r, keep:] = 0
    return batch


def gradients(cfg, origins, batch, num_devices: int):
    """(grads, metrics) of make_gradients on a mesh over the first num_devices devices, the
    grads laid out as their params."""
    sizes = validate(cfg, num_devices, origins)
    mesh = make_mesh(sizes, jax.devices()[:num_devices], dcn=dcn_sizes(cfg))
    graphdef, params, buffers = nnx.split(build_model(cfg, cfg.train.seed), nnx.Param, RouterBias)
    rules = cfg.mesh.rules
    param_shardings = nnx.to_pure_dict(state_shardings(params, mesh, rules))
    params, buffers = nnx.to_pure_dict(params), nnx.to_pure_dict(buffers)
    with use_mesh(mesh, rules):
        fn = make_gradients(cfg, graphdef, spec((None, "batch", "seq")))
        step = jax.jit(lambda p, b, bufs: fn(p, b, (bufs,), None),
                       out_shardings=(param_shardings, None))
        grads, metrics = step(jax.device_put(params, param_shardings),
                              jax.device_put(batch, named(("batch", "seq"))), buffers)
    return jax.device_get((grads, metrics))


def assert_same_step(result, reference):
    (grads, metrics), (ref_grads, ref_metrics) = result, reference
    for key in METRICS:
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-5, atol=1e-7,
                                   err_msg=key)
    for (path, g_ref), g in zip(jax.tree_util.tree_leaves_with_path(ref_grads),
                                jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-6 * np.max(np.abs(g_ref)),
                                   err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def reference():
    cfg, origins = config()
    batch = unequal_batch(cfg)
    return batch, gradients(cfg, origins, batch, num_devices=1)


def test_batch_has_unequal_microbatches(reference):
    batch, _ = reference
    mask = batch["loss_mask"]
    tokens = mask.reshape(-1, 2, mask.shape[1]).sum(axis=(0, 2))  # microbatches of A = 2
    assert tokens[0] > 3 * tokens[1]
    assert mask.sum(axis=1)[3] == 0  # a row with no loss token at all


@pytest.mark.parametrize("accum", [2, 4])
def test_accumulated_step_equals_unsplit_batch(accum, reference):
    batch, ref = reference
    cfg, origins = config(f"train.grad_accum_steps={accum}")
    assert_same_step(gradients(cfg, origins, batch, num_devices=1), ref)


@pytest.mark.slow
def test_accumulation_on_eight_devices(reference):
    """fsdp 2 x expert 2 x data 2: the microbatch split keeps the batch sharded."""
    batch, ref = reference
    cfg, origins = config("train.grad_accum_steps=2", "mesh.fsdp=2", "mesh.expert=2",
                          "mesh.data=2")
    assert_same_step(gradients(cfg, origins, batch, num_devices=8), ref)


def test_dispatch_rounds_is_the_max_over_microbatches():
    """Two microbatches, the second needing 3 exchange rounds where the first needs 1: the
    step reports 3 (the rounds the worst microbatch ran), not their mean 2; a mean-combined
    metric beside it stays a mean."""
    out = accumulated({"dispatch_rounds": jnp.array([1.0, 3.0]),
                       "update_ratio": jnp.array([1.0, 3.0])})
    assert float(out["dispatch_rounds"]) == 3.0
    assert float(out["update_ratio"]) == 2.0
