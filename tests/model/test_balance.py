"""DeepSeek-V3 auxiliary-loss-free balancing and multi-token prediction inside the train step.

The router bias is state outside the optimizer: after one step it moved by exactly
speed * sign(mean load - load) per expert (DeepSeek-V3 2.1.2), the optimizer state has no entry
for it, and the loss adds mtp_loss_weight x the MTP loss."""

import jax
import numpy as np
import pytest

from maxmoe.sharding import make_mesh
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate
from tests.helpers import random_batch, small_config

DEEPSEEK = ["attention.kind=mla", "attention.num_kv_heads=4", "attention.q_lora_rank=16",
            "attention.kv_lora_rank=16", "attention.qk_nope_head_dim=8",
            "attention.qk_rope_head_dim=8", "attention.v_head_dim=8", "moe.router=sigmoid",
            "moe.num_groups=4", "moe.groups_per_token=2", "moe.routed_scaling_factor=2.5",
            "moe.aux_loss_weight=0", "moe.z_loss_weight=0", "moe.bias_update_speed=0.01",
            "moe.sequence_balance_loss_weight=0.0001", "model.mtp_depth=1",
            "model.remat_policy=none", "optimizer.warmup_steps=1", "data.global_batch_size=4"]


@pytest.fixture(scope="module")
def stepped():
    cfg, origins = small_config(*DEEPSEEK)
    mesh = make_mesh(validate(cfg, 1, origins), jax.devices()[:1])
    trainer = make_trainer(cfg, mesh)
    state = trainer.init()
    before = jax.device_get(state["buffers"])
    new_state, metrics = trainer.step(state, random_batch(cfg))
    return cfg, before, jax.device_get(new_state), jax.device_get(metrics)


def test_router_bias_moves_by_the_sign_rule_outside_the_optimizer(stepped):
    cfg, before, state, metrics = stepped
    load = metrics["expert_load"]  # [MoE layers + MTP, E]
    biases = [before["layer_groups"][1]["mlp"]["bias"], before["mtp"][0]["block"]["mlp"]["bias"][None]]
    after = [state["buffers"]["layer_groups"][1]["mlp"]["bias"],
             state["buffers"]["mtp"][0]["block"]["mlp"]["bias"][None]]
    want = np.sign(load.mean(-1, keepdims=True) - load) * cfg.moe.bias_update_speed
    np.testing.assert_allclose(np.concatenate(after) - np.concatenate(biases), want, atol=1e-7)
    assert np.any(want != 0)
    # not a trainable param: absent from params and from every optimizer moment
    flat = jax.tree_util.tree_flatten_with_path((state["params"], state["opt_state"]))[0]
    assert not any("bias" in jax.tree_util.keystr(path) for path, _ in flat)


def test_loss_adds_weighted_mtp_and_sequence_balance_losses(stepped):
    cfg, _, _, metrics = stepped
    want = (metrics["ce_loss"] + cfg.model.mtp_loss_weight * metrics["mtp_loss"]
            + cfg.moe.sequence_balance_loss_weight * metrics["sequence_balance_loss"])
    np.testing.assert_allclose(metrics["loss"], want, rtol=1e-6)
    assert 0 < metrics["mtp_loss"] < 10


@pytest.mark.parametrize("scan", ["true", "false"])
def test_router_bias_update_reaches_every_moe_layer_in_order(scan):
    """update_router_bias on the model alone, stacked and per-layer layouts: MoE layer i (and
    then the MTP block) takes row i of the load."""
    from maxmoe.model.transformer import build_model

    cfg, _ = small_config(*DEEPSEEK, "model.num_layers=4", f"model.scan_layers={scan}")
    model = build_model(cfg, 0)
    moe_rows = cfg.model.num_layers - cfg.model.num_dense_layers + cfg.model.mtp_depth
    ranks = np.tile(np.arange(cfg.moe.num_experts, dtype=np.float32), (moe_rows, 1))
    load = np.random.default_rng(0).permuted(ranks, axis=1)  # each row its own order
    assert len({row.tobytes() for row in np.sign(load - load.mean(-1, keepdims=True))}) > 1
    model.update_router_bias(jax.numpy.asarray(load), 0.5)
    groups = model.layer_groups[1]
    trunk = ([np.asarray(b.mlp.bias[...]) for b in groups] if scan == "false"
             else list(np.asarray(groups.mlp.bias[...])))
    got = np.stack(trunk + [np.asarray(model.mtp[0].block.mlp.bias[...])])
    np.testing.assert_array_equal(got, np.sign(load.mean(-1, keepdims=True) - load) * 0.5)
