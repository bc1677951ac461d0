"""Every 8-device layout computes the same first-step loss and gradients as one device.

Reference: the same model and batch on a single CPU device, float32. Tolerance: loss within
1e-5 relative; every gradient within rtol 1e-4, atol 1e-6 (observed ~1e-8: only the order of
float32 reductions differs between layouts).
"""

import jax
import numpy as np
import pytest

from tests.helpers import loss_and_grads, random_batch, small_config

LAYOUTS = {
    "data8": ["mesh.data=8"],
    "fsdp8": ["mesh.fsdp=8"],
    "expert8": ["mesh.expert=8"],
    "data2_fsdp2_expert2": ["mesh.fsdp=2", "mesh.expert=2"],
    "fsdp2_expert2_tensor2": ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"],
    "data4_tensor2": ["mesh.tensor=2"],
    "expert4_tensor2": ["mesh.expert=4", "mesh.tensor=2"],
}


@pytest.fixture(scope="module")
def reference():
    cfg, origins = small_config()
    batch = random_batch(cfg)
    return batch, loss_and_grads(cfg, origins, batch, num_devices=1)


# capacity mode with factor = num_experts has a slot for every assignment: nothing is dropped,
# so it must equal the dropless single-device reference too
DISPATCH = {"dropless": [], "capacity": ["moe.dispatch=capacity", "moe.capacity_factor=8.0"]}


@pytest.mark.parametrize("dispatch", list(DISPATCH))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_device(name, dispatch, reference):
    batch, (ref_loss, ref_metrics, ref_grads) = reference
    cfg, origins = small_config(*LAYOUTS[name], *DISPATCH[dispatch])
    loss, metrics, grads = loss_and_grads(cfg, origins, batch, num_devices=8)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["expert_load_max"], ref_metrics["expert_load_max"])
    assert metrics["dropped_fraction"] == 0.0
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    flat = jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref)
    for (path, g_ref), g in zip(flat_ref, flat):
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
