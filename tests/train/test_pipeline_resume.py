"""A checkpoint saved with one pipeline stage count resumes with another.

Params are stored in natural layer order whatever the stages (parallel/pipeline.py regroups
them inside the step), so the tree and its shapes do not depend on mesh.pipeline, and the
resumed run computes what the saving run would have: the same loss on the next batch.
"""

import jax
import numpy as np
import pytest

from maxmoe.config import CheckpointConfig
from maxmoe.sharding import make_mesh
from maxmoe.train.checkpoint import Checkpointer
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate
from tests.helpers import random_batch, small_config

MODEL = ["model.num_layers=7", "model.remat_policy=none"]  # 1 dense + 6 MoE layers


def _trainer(*layout):
    cfg, origins = small_config(*MODEL, *layout)
    return make_trainer(cfg, make_mesh(validate(cfg, 8, origins))), cfg


@pytest.mark.slow
def test_two_stage_checkpoint_resumes_on_four_unequal_stages(tmp_path):
    two, cfg = _trainer("mesh.pipeline=2")  # 2 chunks of 3 layers
    four, _ = _trainer("mesh.pipeline=4")  # chunks of 1, 1, 2, 2 (padded to 2)
    state, _ = two.step(two.init(), random_batch(cfg, seed=1))
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1, async_save=False)) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        resumed = ckpt.resume(four.abstract_state)
    assert resumed is not None and resumed.step == 1
    saved = jax.device_get(state["params"])
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(jax.device_get(
            resumed.state["params"])), strict=True):
        np.testing.assert_array_equal(a, b)
    batch = random_batch(cfg, seed=2)
    _, want = two.step(state, batch)
    _, got = four.step(resumed.state, batch)
    # float32; only the order of reductions differs between the layouts
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["expert_load_max"], want["expert_load_max"])
