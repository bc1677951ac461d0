"""Facts derived from the model config alone: layer groups against the per-layer kind rule,
the pipeline bubble against a count of the idle slots of the schedule's grid."""

import dataclasses
import itertools

import pytest

from maxmoe.config import ModelConfig
from maxmoe.model.spec import describe_pipeline, layer_groups, pipeline_schedule


@pytest.mark.parametrize("fields", [
    dict(num_layers=6, num_dense_layers=1),  # DeepSeek: first k dense
    dict(num_layers=8, num_dense_layers=0, moe_layer_step=2),  # every second layer MoE
    dict(num_layers=7, num_dense_layers=0, dense_layer_indices=[2, 3]),  # Qwen3 mlp_only_layers
])
def test_layer_groups_cover_every_layer_in_runs_of_its_kind(fields):
    """Expanding the groups gives layer i's kind as the config's fields define it, layer by
    layer, and neighbouring groups differ in kind (runs are maximal)."""
    model = dataclasses.replace(ModelConfig(), **fields)
    dense = set(fields.get("dense_layer_indices", []))
    want = [not (i < fields["num_dense_layers"] or i in dense
                 or (i + 1) % fields.get("moe_layer_step", 1)) for i in range(fields["num_layers"])]
    groups = layer_groups(model)
    got = [is_moe for is_moe, _, n in groups for _ in range(n)]
    assert got == want
    assert [first for _, first, _ in groups] == [sum(n for _, _, n in groups[:g])
                                                  for g in range(len(groups))]
    assert all(a[0] != b[0] for a, b in itertools.pairwise(groups))


@pytest.mark.parametrize("kind, stages, microbatches, repeats, want_m", [
    ("gpipe", 4, 0, 2, 4),  # microbatches 0 = stages; repeats ignored by gpipe
    ("gpipe", 2, 6, 2, 6),
    ("circular", 4, 6, 3, 4),  # circular: M = P whatever pipeline_microbatches says
])
def test_bubble_is_the_idle_share_of_the_schedule_grid(kind, stages, microbatches, repeats,
                                                       want_m):
    """Stage p works at iteration t on virtual microbatch t - p when it lies in [0, V M)
    (parallel/pipeline.py); the bubble is the idle share of all (stage, iteration) slots."""
    model = dataclasses.replace(ModelConfig(), pipeline_schedule=kind,
                                pipeline_microbatches=microbatches, pipeline_repeats=repeats)
    s = pipeline_schedule(model, stages)
    v = repeats if kind == "circular" else 1
    assert (s.stages, s.repeats, s.microbatches) == (stages, v, want_m)
    busy = sum(0 <= t - p < v * want_m for p in range(stages) for t in range(s.iterations))
    assert busy == stages * v * want_m  # every stage sees every pass of every microbatch
    assert s.bubble == pytest.approx(1 - busy / (stages * s.iterations))


def test_only_groups_that_stages_times_repeats_divide_are_pipelined():
    """1 dense + 4 MoE layers on 2 stages: the MoE group is pipelined, the dense layer runs on
    every stage; circular with 4 repeats divides neither; one stage pipelines nothing."""
    model = dataclasses.replace(ModelConfig(), num_layers=5, num_dense_layers=1)
    sizes = [n for _, _, n in layer_groups(model)]
    assert [pipeline_schedule(model, 2).pipelines(n) for n in sizes] == [False, True]
    circular = dataclasses.replace(model, pipeline_schedule="circular", pipeline_repeats=4)
    assert not any(pipeline_schedule(circular, 2).pipelines(n) for n in sizes)
    assert not any(pipeline_schedule(model, 1).pipelines(n) for n in sizes)
    assert describe_pipeline(model, 1) is None
    line = describe_pipeline(model, 2)
    assert "2 stages x 1 repeats, 2 microbatches, bubble 33.3%" in line
    assert line.endswith("4 layers pipelined, 1 run on every stage")
