"""model.outer_microbatches: the work outside the pipelined layers over groups of rows
(parallel/row_groups.py) gives the whole batch's loss, metrics and gradients, and its compiled
temporaries are one group's.

Reference: the same model and batch with model.outer_microbatches=1 (all rows at once), float32.
Tolerance: rtol 1e-5 on the loss, rtol 1e-4 / atol 1e-6 on gradients and metrics (only the
order of float32 sums differs).
"""

import jax
import numpy as np
import pytest

from maxmoe.bench import memory_analysis
from maxmoe.config import ConfigError
from maxmoe.config_files import load_config
from maxmoe.plan.probe import abstract_batch
from maxmoe.sharding import make_mesh, use_mesh
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate
from tests.helpers import loss_and_grads, random_batch, small_config

# a dense layer (unpipelined stack), MoE layers, sigmoid routing with its sequence-wise
# balance loss, MTP with its own MoE layer, the chunked head: everything outside in groups
DEEPSEEK = ["model.mtp_depth=1", "moe.router=sigmoid", "moe.sequence_balance_loss_weight=0.01",
            "moe.aux_loss_weight=0.01", "moe.z_loss_weight=0.001", "model.lm_loss_chunk=8"]
METRICS = ("ce_loss", "mtp_loss", "balance_loss", "z_loss", "sequence_balance_loss",
           "expert_load", "activation_rms", "dense_activation_rms", "router_entropy")


def _check_equal(base: list[str], groups: int, devices: int):
    cfg, origins = small_config(*base)
    batch = random_batch(cfg)
    ref_loss, ref_metrics, ref_grads = loss_and_grads(cfg, origins, batch, num_devices=devices)
    cfg, origins = small_config(*base, f"model.outer_microbatches={groups}")
    loss, metrics, grads = loss_and_grads(cfg, origins, batch, num_devices=devices)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for key in METRICS:
        np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-4, atol=1e-6,
                                   err_msg=key)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    for (path, g_ref), g in zip(flat_ref, jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("chunk", [8, 0])
def test_row_groups_equal_all_rows_at_once_on_one_device(chunk):
    """4 groups of 4 rows; the chunked head (MTP blocks rematerialised per group) and the
    unchunked one (each group's whole pass rematerialised)."""
    _check_equal([*DEEPSEEK, f"model.lm_loss_chunk={chunk}"], groups=4, devices=1)


@pytest.mark.slow
def test_row_groups_equal_all_rows_at_once_pipelined():
    """2 stages x fsdp 2 x expert 2: the dense prefix, head, loss and MTP in 2 groups of the
    2 rows each device holds outside the pipeline."""
    _check_equal([*DEEPSEEK, "model.num_layers=5", "mesh.pipeline=2", "mesh.fsdp=2",
                  "mesh.expert=2", "mesh.data=1"], groups=2, devices=8)


def test_groups_that_do_not_divide_the_rows_are_refused():
    cfg, origins = small_config("model.outer_microbatches=3")  # 16 rows on one device
    with pytest.raises(ConfigError, match=r"model.outer_microbatches.*divide the 16 rows"):
        validate(cfg, 1, origins)


# the tiny DeepSeek-V3 pipeline model (configs/models/tiny_deepseek_v3.yaml: a dense layer, MLA, MTP with its own MoE
# layer) on 4 stages x fsdp 2, head-heavy: a 16384-token vocabulary, no lm_loss_chunk, so the
# logits f32 [rows, 64, 16384] (4 MiB a row) and their gradient dominate; 64 sequences, 8 rows
# a device outside the pipeline
OUTER_HEAVY = ["mesh.pipeline=4", "mesh.fsdp=2", "mesh.expert=1", "mesh.data=1",
               "model.num_layers=5", "model.pipeline_schedule=gpipe", "model.vocab_size=16384",
               "data.seq_len=64", "data.global_batch_size=64", "model.remat_policy=full",
               "model.pipeline_microbatches=4"]


def _temporaries(*overrides: str) -> int:
    cfg, origins = load_config(["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml",
                                "configs/mesh/cpu8_pipeline.yaml"], list(overrides))
    trainer = make_trainer(cfg, make_mesh(validate(cfg, 8, origins)))
    with use_mesh(trainer.mesh, trainer.rules):
        compiled = trainer.jitted_step.lower(
            trainer.abstract_state, abstract_batch(cfg, trainer.batch_sharding)).compile()
    return memory_analysis(compiled)["temp_bytes"]


@pytest.mark.slow
def test_row_groups_bound_the_outside_temporaries():
    """The compiled pipelined train step's temporaries with the outside work in 8 groups of 1
    row a device (model.outer_microbatches=8) against all 8 rows at once (the code path before
    model.outer_microbatches). Property: grouped < 0.7 x whole. The logits and their gradient
    dominate, so holding one group's at a time roughly halves the temporaries; without the
    grouping (or with a head that keeps every group's logits) the ratio is 1.0 or more and the
    test fails. Measured ratios: docs/performance/parallelism.md, "Outside work in chunks"."""
    grouped = _temporaries(*OUTER_HEAVY, "model.outer_microbatches=8")
    whole = _temporaries(*OUTER_HEAVY)
    assert grouped < 0.7 * whole, (grouped / whole, grouped, whole)
