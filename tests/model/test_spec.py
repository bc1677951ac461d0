"""Facts derived from the model config alone: layer groups against the per-layer kind rule,
which groups the pipeline takes, and the start-up line's idle share."""

import dataclasses
import itertools

import pytest

from maxmoe.config import ModelConfig
from maxmoe.model.spec import describe_pipeline, layer_groups
from maxmoe.parallel.schedule import pipeline_schedule


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


def test_groups_with_a_layer_per_chunk_are_pipelined():
    """1 dense + 4 MoE layers on 2 stages: the MoE group is pipelined, the dense layer runs on
    every stage; circular with 4 repeats has no layer for each of 8 chunks; one stage
    pipelines nothing; an explicit split pipelines only the group it sums to."""
    model = dataclasses.replace(ModelConfig(), num_layers=5, num_dense_layers=1)
    sizes = [n for _, _, n in layer_groups(model)]
    assert [pipeline_schedule(model, 2).pipelines(n) for n in sizes] == [False, True]
    assert [pipeline_schedule(model, 3).pipelines(n) for n in sizes] == [False, True]
    circular = dataclasses.replace(model, pipeline_schedule="circular", pipeline_repeats=4)
    assert not any(pipeline_schedule(circular, 2).pipelines(n) for n in sizes)
    assert not any(pipeline_schedule(model, 1).pipelines(n) for n in sizes)
    explicit = dataclasses.replace(model, pipeline_stage_layers=[3, 2])
    assert [pipeline_schedule(explicit, 2).pipelines(n) for n in sizes] == [False, False]


def test_start_up_line_counts_padding_in_the_idle_share():
    """DeepSeek-V3's 58 MoE layers on 16 stages, 32 microbatches: chunks of 3-4 layers, 6 of
    64 slots padding; idle = 1 - (1 - bubble)(1 - padding)."""
    model = dataclasses.replace(ModelConfig(), num_layers=61, num_dense_layers=3,
                                pipeline_microbatches=32)
    line = describe_pipeline(model, 16)
    bubble, padding = 15 / 47, 6 / 64
    assert "chunks of 3-4 layers" in line and f"padding {100 * padding:.1f}%" in line
    assert f"idle {100 * (1 - (1 - bubble) * (1 - padding)):.1f}%" in line
    assert "58 layers pipelined" in line and "3 run on every stage" in line
