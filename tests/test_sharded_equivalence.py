"""Every 8-device layout computes the same first-step loss and gradients as one device.

Reference: the same model and batch on a single CPU device, float32. Tolerance: loss within
1e-5 relative; every gradient within rtol 1e-4, atol 1e-6 (observed ~3e-8: only the order of
float32 reductions differs between layouts).

Pipeline layouts split the batch into microbatches. Their runs keep every router loss on, at
weights large enough to move the router gradients past the tolerance if a loss were formed per
microbatch: the Switch balance loss is built from the batch's summed load and mean affinity,
the sequence-wise loss and the z-loss are means of per-row / per-token terms
(model/router.py), so pipelined and unpipelined steps optimise the same loss.
"""

import jax
import numpy as np
import pytest

from maxmoe.model.spec import layer_groups, pipeline_schedule
from maxmoe.parallel.pipeline import num_stages
from maxmoe.sharding import make_mesh, use_mesh
from maxmoe.validation import validate
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
PIPELINE = ["model.num_layers=5",  # 1 dense + 4 MoE layers; every router loss on
            "moe.aux_loss_weight=0.1", "moe.z_loss_weight=0.01",
            "moe.sequence_balance_loss_weight=0.1"]
PIPELINE_LAYOUTS = {
    "pipeline2_data4": ["mesh.pipeline=2"],
    "pipeline4_data2": ["mesh.pipeline=4"],
    "pipeline2_expert2_fsdp2_gpipe4": ["mesh.pipeline=2", "mesh.expert=2", "mesh.fsdp=2",
                                       "model.pipeline_microbatches=4"],
    "pipeline2_tensor2_circular": ["mesh.pipeline=2", "mesh.tensor=2",
                                   "model.pipeline_schedule=circular"],
    # unequal stages: 3 + 1 MoE layers, the second stage padded with two identity slots
    "pipeline2_expert2_fsdp2_layers31": ["mesh.pipeline=2", "mesh.expert=2", "mesh.fsdp=2",
                                         "model.pipeline_stage_layers=[3,1]"],
    # circular with more microbatches than stages (outputs wait for stage 0's next pass)
    "pipeline2_circular_micro4": ["mesh.pipeline=2", "model.pipeline_schedule=circular",
                                  "model.pipeline_microbatches=4"],
}
# capacity mode with factor = num_experts has a slot for every assignment: nothing is dropped,
# so it must equal the dropless single-device reference too
DISPATCH = {"dropless": [], "capacity": ["moe.dispatch=capacity", "moe.capacity_factor=8.0"]}


@pytest.fixture(scope="module")
def references():
    out = {}
    for name, extra in (("plain", []), ("pipeline", PIPELINE)):
        cfg, origins = small_config(*extra)
        batch = random_batch(cfg)
        out[name] = batch, loss_and_grads(cfg, origins, batch, num_devices=1)
    return out


def _check(overrides, reference):
    batch, (ref_loss, ref_metrics, ref_grads) = reference
    cfg, origins = small_config(*overrides)
    loss, metrics, grads = loss_and_grads(cfg, origins, batch, num_devices=8)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["expert_load_max"], ref_metrics["expert_load_max"])
    assert metrics["dropped_fraction"] == 0.0
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    flat = jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref)
    for (path, g_ref), g in zip(flat_ref, flat, strict=True):
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
    return cfg, origins


def _cases(layouts):
    return [(name, dispatch) for name in layouts for dispatch in DISPATCH]


@pytest.mark.parametrize("name, dispatch", _cases(LAYOUTS))
def test_layout_matches_single_device(name, dispatch, references):
    _check(LAYOUTS[name] + DISPATCH[dispatch], references["plain"])


@pytest.mark.parametrize("name, dispatch", _cases(PIPELINE_LAYOUTS))
def test_pipeline_layout_matches_single_device(name, dispatch, references):
    cfg, origins = _check(PIPELINE + PIPELINE_LAYOUTS[name] + DISPATCH[dispatch],
                          references["pipeline"])
    # the MoE group really ran pipelined (not replicated on every stage)
    sizes = validate(cfg, 8, origins)
    with use_mesh(make_mesh(sizes), cfg.mesh.rules):  # the stages the model reads
        schedule = pipeline_schedule(cfg.model, num_stages())
    assert [schedule.pipelines(n) for _, _, n in layer_groups(cfg.model)] == [False, True]
