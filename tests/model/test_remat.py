"""Memory policies: named-tensor remat (saved or offloaded to host) gives the gradients of no
remat, the names are really in the model, and optimizer state can live in host memory.

float32, one device. Tolerance as in test_transformer.py: rtol 1e-5, atol 1e-7 on every
gradient (the same math; only XLA's fusion and recomputation order differ). On CPU the
offload policy runs but moves nothing (RUNTIME_FACTS.md): this checks wiring, not savings.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from maxmoe.model.block import SAVED_NAMES
from maxmoe.model.transformer import build_model
from maxmoe.sharding import global_batch, make_mesh
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate
from tests.helpers import random_batch, small_config

# one dense and one MoE layer: every tagged tensor occurs, and it compiles quickly
LAYERS = ("model.num_layers=2", "model.num_dense_layers=1")


def _loss_and_grad(cfg, batch):
    graphdef, variables = nnx.split(build_model(cfg, 0))
    params = nnx.to_pure_dict(variables)
    return jax.value_and_grad(lambda p: nnx.merge(graphdef, p).loss(batch)[0]), params


@pytest.fixture(scope="module")
def reference():
    cfg, _ = small_config("model.remat_policy=none", *LAYERS)
    batch = random_batch(cfg)
    f, params = _loss_and_grad(cfg, batch)
    return cfg, batch, jax.jit(f)(params)


@pytest.mark.parametrize("policy", ["save_named", "offload_named"])
def test_named_policies_give_equal_loss_and_grads(reference, policy):
    cfg, batch, (ref_loss, ref) = reference
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat_policy=policy))
    f, params = _loss_and_grad(other, batch)
    loss, got = jax.jit(f)(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_every_saved_name_is_tagged_in_the_model(attention):
    extra = ["attention.kind=mla", "attention.kv_lora_rank=16", "attention.qk_nope_head_dim=8",
             "attention.qk_rope_head_dim=8", "attention.v_head_dim=8"] if attention == "mla" else []
    cfg, _ = small_config("model.remat_policy=save_named", *LAYERS, *extra)
    f, params = _loss_and_grad(cfg, random_batch(cfg))
    text = str(jax.make_jaxpr(f)(params))  # tracing only, no compilation
    for name in SAVED_NAMES:
        assert f"name={name}" in text, name


def test_optimizer_state_in_host_memory_trains_identically():
    """Dense 2-layer model: the offload path is the optimizer's, not the model's."""
    states = {}
    for offload in (False, True):
        cfg, origins = small_config("model.remat_policy=none", "model.num_layers=2",
                                    "model.num_dense_layers=2",
                                    f"optimizer.offload_state={str(offload).lower()}")
        trainer = make_trainer(cfg, make_mesh(validate(cfg, 1, origins), jax.devices()[:1]))
        state = trainer.init()
        for seed in range(2):
            state, _ = trainer.step(state, global_batch(random_batch(cfg, seed),
                                                        trainer.batch_sharding))
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state["opt_state"])}
        assert kinds == ({"pinned_host"} if offload else {"device"})
        assert {x.sharding.memory_kind for x in jax.tree.leaves(state["params"])} == {"device"}
        states[offload] = jax.device_get(state)
    for a, b in zip(jax.tree.leaves(states[True]), jax.tree.leaves(states[False]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)
