"""The DeepSeek recipe's work outside the pipeline under XLA:GPU's deviceless compile.

configs/experiments/deepseek_v3_2048xh800.yaml stores the params over the stages too
(mesh.rules embed: [fsdp, pipeline]) and runs the dense prefix, embedding, LM head, loss and
MTP outside the pipeline on model.outer_microbatches row groups (a scan each way). There the
stage axis splits the rows, as data does, so under mesh.weights zero1 the compute copy of those
params is replicated over it (train/gradients.py compute_shardings): the row-group loops hold
no all-gather or reduce-scatter over the stage axis. Before (the copy split over the stages
where storage put them) every row group gathered the dense layers and the LM head / MTP over
it, forward and in the backward's rematerialisation, and reduce-scattered their gradients:
at 671B 71.0 GB of all-gathers and 59.8 GB of reduce-scatters per device per step across
hosts, many synchronous. This test fails on the commit before that change (the row-group
loops held 8 such collectives of 2-452 KB).

Nor any reduction (all-reduce, reduce-scatter) of >= SMALL result bytes over the stage axis:
the dense prefix's weight gradients were all-reduced over the stages inside every row group
(at 671B 3 all-reduces x 21 executions, ~46 GB across hosts per device per step), its copy's
replicas held over the data-parallel axes alone. Its replicas now span the stage axes too
(train/gradients.py unpiped_groups, parallel/replicas.py stack_replicas), so they are added
once per step. Main before that change fails it (dense-layer gradient all-reduces over fsdp,
expert and pipeline found in the loops).

The `gpu_aot` group; the recipe at tiny size on 16 deviceless H100s in 2 hosts (pipeline 2
across them x fsdp 2 x expert 4), bf16, 2 row groups, 3 dense layers (as V3: a layer scan in
the row-group loops, whose per-layer gradient XLA cannot hoist out of them).
"""

import functools
import re

import numpy as np
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="jax[cuda12] plugin not installed")
pytest.importorskip("tokamax", reason="tokamax not installed")

from maxmoe.plan.collectives import replica_groups  # noqa: E402
from maxmoe.plan.hlo import attr, callees, known_trip_count, parse_module, shape_bytes  # noqa: E402
from maxmoe.plan.probe import compile_step  # noqa: E402

pytestmark = pytest.mark.gpu_aot

GROUPS = 2  # model.outer_microbatches
RECIPE = ["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml",
          "configs/experiments/deepseek_v3_2048xh800.yaml", "precision.compute_dtype=bfloat16",
          "data.seq_len=64", "data.global_batch_size=32", "model.num_layers=7",
          "model.num_dense_layers=3",
          "model.pipeline_microbatches=4", f"model.outer_microbatches={GROUPS}",
          "model.lm_loss_chunk=16", "mesh.pipeline=2", "mesh.dcn_pipeline=2", "mesh.expert=4",
          "mesh.dcn_expert=1", "mesh.fsdp=2", "mesh.dcn_fsdp=1"]
MOVING = ("all-gather", "reduce-scatter")
REDUCING = ("all-reduce", "reduce-scatter")
SMALL = 1024  # bytes: above a scalar metric's, below any layer's weight


def row_group_instructions(hlo: str):
    """Instructions of the row-group loops (the entry's while loops of GROUPS iterations:
    over_row_groups' scans, forward and backward) and of every computation they call."""
    comps, entry = parse_module(hlo)
    todo = [attr(ins.attrs, "body").lstrip("%") for ins in comps[entry]
            if ins.opcode == "while" and known_trip_count(ins) == GROUPS]
    assert todo, "no row-group loop found"
    seen, found = set(), []
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for ins in comps[name]:
            todo += callees(ins)
            found.append(ins)
    return found


def entry_instructions(hlo: str):
    """Instructions of the entry computation itself (outside every loop)."""
    comps, entry = parse_module(hlo)
    return comps[entry]


def stage_axis_collectives(hlo: str, mesh, kinds: tuple[str, ...],
                           where=row_group_instructions) -> list[str]:
    """Collectives of `kinds` (opcode prefixes) of >= SMALL result bytes among where(hlo) (the
    row-group loops) whose device groups span the pipeline axis. Partition i is
    mesh.devices.flat[i]."""
    axis = list(mesh.shape).index("pipeline")
    coords = np.array(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)).T
    found = []
    for ins in where(hlo):
        if not ins.opcode.startswith(kinds) or ins.opcode.endswith("done") \
                or shape_bytes(ins.type) < SMALL:
            continue
        c = coords[np.asarray(replica_groups(ins.attrs, mesh.devices.size))]
        if (c[..., axis] != c[:, :1, axis]).any():
            op = re.search(r'op_name="([^"]*)"', attr(ins.attrs, "metadata") or "")
            found.append(f"{ins.opcode} {ins.type[:60]} {op.group(1)[-60:] if op else ''}")
    return found


@functools.cache
def compiled():
    """(HLO text, mesh) of RECIPE, compiled once per process (one 16-device compile)."""
    setup, step, _ = compile_step(RECIPE, 16, 2, "gpu", "h100")
    return step.as_text(), setup.trainer.mesh


def test_row_groups_move_no_weight_over_the_stages():
    assert stage_axis_collectives(*compiled(), MOVING) == []


def test_row_groups_reduce_no_gradient_over_the_stages():
    """The dense prefix's gradients (and the head's: replicas.on_outer_replicas) are reduced
    over the stages once per step, after the row-group loops, not in them."""
    assert stage_axis_collectives(*compiled(), REDUCING) == []


def test_pipeline_output_leaves_stage_zero_in_its_own_width():
    """The pipeline's output rows, held by stage 0 after the loop, reach every stage as a sum
    over the stage axis of the other stages' zeros (parallel/stage_words.stage_zero): in int32
    words of the bf16 rows, since XLA:GPU reduces a bf16 sum in float32, twice the bytes (at
    671B a 12.3 GB float32 reduce-scatter across hosts per device per step, and a 13 GB float32
    buffer). The forward's reductions over the stage axis: none in float32, and one in s32."""
    hlo, mesh = compiled()
    forward = [c for c in stage_axis_collectives(hlo, mesh, REDUCING, entry_instructions)
               if " jit(train_step)/jvp(" in c]
    assert not [c for c in forward if "f32[" in c], forward
    assert [c for c in forward if "s32[" in c], forward
