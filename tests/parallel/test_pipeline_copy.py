"""zero1 under the pipeline, a stack the stages do not divide (7 MoE layers on 4 stages, as
V3's 58 on 16): each device reads its stage's share of the routed experts from the compute
copy (sharding.stack_source_spec keeps the stage axes where storage put them), never the whole
stack. Main at cae723a lost that split inside the replicas' trace: float32 [7, 8, 128, 64]
buffers (every layer's and expert's weights) in the backward, 406 GiB a device on the 671B
recipe under precision.fp8 (docs/performance/parallelism.md, "Outside the pipeline under
zero1"). XLA:CPU, 8 fake devices, in a subprocess (plan/probe.py)."""

import math

import jax.numpy as jnp
from flax import nnx

from maxmoe.parallel.replicas import stack_source
from maxmoe.plan.probe import run_probe
from maxmoe.sharding import compute_copy, make_mesh, use_mesh
from maxmoe.validation import validate
from tests.helpers import small_config

ITEMS = ["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml",
         "precision.compute_dtype=bfloat16", "mesh.data=1", "mesh.fsdp=1", "mesh.pipeline=4",
         "mesh.expert=2", "model.num_layers=8", "model.pipeline_microbatches=4",
         "data.global_batch_size=16", "data.seq_len=64", "mesh.weights=zero1",
         "model.outer_microbatches=2"]


def test_no_device_holds_the_whole_routed_expert_stack():
    measured = run_probe(ITEMS, 8, 1, 8)
    whole = 7 * 8 * 128 * 64  # MoE layers x experts x hidden x expert MLP: one weight, whole
    for buf in measured["largest_buffers"]:
        assert math.prod(buf["shape"]) < whole, buf


def test_routed_experts_keep_their_expert_split_without_replicas():
    """stack_source of a routed-expert stack [L, E, D, F] on a compute copy with no replicas
    (zero1 where data x fsdp is 1, or any copy under precision.fp8): the expert dim stays split
    over the expert axis. Main at 9b08e2c took its own "experts" axis for the copy's
    expert-group replica dim and left it whole: under FP8 each stage exchanged all 256 experts
    of V3's stack (28 GiB bf16 [64, 256, 448, 2048] all-to-alls, 131.6 GiB a device)."""
    cfg, origins = small_config("mesh.pipeline=4", "mesh.fsdp=1", "mesh.data=1",
                                "mesh.expert=2", "model.num_layers=8", "mesh.weights=zero1")
    var = nnx.Param(jnp.zeros((7, 8, 128, 64)), axes=("experts", "embed", "mlp"))
    with use_mesh(make_mesh(validate(cfg, 8, origins)), cfg.mesh.rules), \
            compute_copy("zero1", {}):
        source = tuple(stack_source(var))
    assert source[:2] == (None, "expert"), source
