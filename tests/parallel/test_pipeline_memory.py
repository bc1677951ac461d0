"""The pipelined step's temporaries are bounded by one stage's weights, not by the schedule.

Differentiating the scan over pipeline iterations keeps, for the backward, whatever each
iteration computed from its loop index: the weights each stage picked for its pass. Kept per
iteration, that is iterations x one stage's weights; per-iteration remat keeps only the stage
inputs. What this cost at 13B and 671B: docs/performance/parallelism.md, "Pipeline memory at
scale".
"""

import math

import jax
import pytest

from maxmoe.bench import memory_analysis
from maxmoe.parallel.schedule import pipeline_schedule
from maxmoe.plan.probe import abstract_batch
from maxmoe.sharding import make_mesh, use_mesh
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate
from tests.helpers import small_config

# weights dominate: 2 MoE layers of 16 experts x 64 x 512 (6.3 MB each, f32), tiny activations
# (4 rows of 16 tokens per microbatch, hidden 64)
SHAPE = ["model.num_layers=3", "moe.num_experts=16", "moe.expert_mlp_size=512",
         "data.seq_len=16", "data.global_batch_size=64", "precision.compute_dtype=bfloat16",
         "model.remat_policy=full", "model.pipeline_microbatches=16"]


def _temps_and_stage_bytes(*overrides: str) -> tuple[int, int, int]:
    """(temporary bytes per device of the compiled train step, f32 bytes of one stage's
    layers, pipeline iterations) on 8 fake devices."""
    cfg, origins = small_config(*SHAPE, *overrides)
    sizes = validate(cfg, 8, origins)
    trainer = make_trainer(cfg, make_mesh(sizes))
    with use_mesh(trainer.mesh, trainer.rules):
        compiled = trainer.jitted_step.lower(
            trainer.abstract_state, abstract_batch(cfg, trainer.batch_sharding)).compile()
    piped = trainer.abstract_state["params"]["layer_groups"][1]  # group 0: the dense layer
    stages = sizes["pipeline"]
    stage_bytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(piped))
    schedule = pipeline_schedule(cfg.model, stages)
    return memory_analysis(compiled)["temp_bytes"], stage_bytes // stages, schedule.iterations


# the circular schedule alone (33 iterations): gpipe runs the same per-iteration stage pass
# (its figures: docs/performance/parallelism.md), and each case is a long CPU compile
@pytest.mark.parametrize("layout", [
    ["mesh.pipeline=2", "model.pipeline_schedule=circular", "model.num_layers=5"]])
def test_pipelined_temporaries_stay_within_a_few_stage_weights(layout):
    """Property: temporaries < 6 x one stage's f32 weights (room for its gathered copy, bf16
    casts, the f32 gradient and the update's temporaries), far below one copy per iteration
    (33 here), so a step that keeps the weights per iteration fails it. Measured multiples, with
    and without per-iteration remat: docs/performance/parallelism.md, "Pipeline memory at
    scale"."""
    temps, stage_bytes, iterations = _temps_and_stage_bytes(*layout)
    assert iterations >= 17
    assert temps < 6 * stage_bytes, (temps / stage_bytes, temps, stage_bytes)
