"""The pipeline schedule: its bubble against a count of the idle slots of the schedule's grid,
and its slot table holding each layer once in chunk order."""

import dataclasses

import pytest

from maxmoe.config import ModelConfig
from maxmoe.parallel.schedule import PipelineSchedule, pipeline_schedule


@pytest.mark.parametrize("kind, stages, microbatches, repeats, want_m", [
    ("gpipe", 4, 0, 2, 4),  # microbatches 0 = stages; repeats ignored by gpipe
    ("gpipe", 2, 6, 2, 6),
    ("circular", 4, 0, 3, 4),  # circular: 0 = stages too
    ("circular", 2, 6, 2, 6),  # circular with more microbatches than stages
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


@pytest.mark.parametrize("layers, stages, repeats, split", [
    (58, 16, 1, ()), (21, 4, 1, ()), (21, 8, 1, ()), (21, 4, 2, ()), (12, 4, 1, (2, 4, 3, 3))])
def test_slot_table_holds_each_layer_once_in_chunk_order(layers, stages, repeats, split):
    """Every layer sits in exactly one slot; chunk v P + p (stage p, pass v) holds consecutive
    layers and the chunks follow layer order; the split is as even as possible (or as given)
    and the padding share counts the -1 slots."""
    s = PipelineSchedule("circular" if repeats > 1 else "gpipe", stages, repeats, stages, split)
    sizes, table, n = s.split(layers), s.slot_table(layers), s.slots(layers)
    assert sum(sizes) == layers and (split or max(sizes) - min(sizes) <= 1)
    chunks = [[x for x in table[c % stages][c // stages * n:(c // stages + 1) * n] if x >= 0]
              for c in range(stages * repeats)]
    assert [x for chunk in chunks for x in chunk] == list(range(layers))
    assert [len(c) for c in chunks] == list(sizes)
    empty = sum(x < 0 for row in table for x in row)
    assert s.padding(layers) == pytest.approx(empty / (stages * repeats * n))
