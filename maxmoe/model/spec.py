"""Facts derived from the model config alone: the runs of same-kind layers (each one stacked
and scanned), which of them the pipeline schedule (parallel/schedule.py) takes, and the rows of
the per-layer metrics. Config checks, FLOP counts, conversion and start-up lines read them here,
so they need not import the model (this file imports only config and the schedule).
"""

from __future__ import annotations

from maxmoe.config import ModelConfig
from maxmoe.parallel.schedule import pipeline_schedule
from maxmoe.sharding import path_keys


def layer_groups(model: ModelConfig) -> list[tuple[bool, int, int]]:
    """(is_moe, first layer, number of layers) for each run of consecutive same-kind layers."""
    dense = set(model.dense_layer_indices)
    kinds = [not (i < model.num_dense_layers or i in dense or (i + 1) % model.moe_layer_step)
             for i in range(model.num_layers)]
    groups: list[tuple[bool, int, int]] = []
    for i, is_moe in enumerate(kinds):
        if groups and groups[-1][0] == is_moe:
            groups[-1] = (is_moe, groups[-1][1], groups[-1][2] + 1)
        else:
            groups.append((is_moe, i, 1))
    return groups


def pipelined_path(model: ModelConfig, stages: int):
    """path (a jax key path into the params, e.g. .layer_groups[1]...) -> whether the
    pipeline runs that param on `stages` stages: a layer group it pipelines. The rest
    (embedding, LM head, MTP, a dense prefix run on every stage) see their rows split over the
    stage axes as over data."""
    schedule = pipeline_schedule(model, stages)
    piped = {i for i, (_, _, n) in enumerate(layer_groups(model)) if schedule.pipelines(n)}

    def staged(path) -> bool:
        keys = path_keys(path)
        return keys[:1] == ("layer_groups",) and keys[1] in piped
    return staged


def pipeline_idle(model: ModelConfig, stages: int) -> float:
    """The idle share of a stage (bubble and padding, PipelineSchedule.idle) for the largest
    pipelined group; the schedule's bubble where no group is pipelined, 0 for one stage."""
    schedule = pipeline_schedule(model, stages)
    piped = [n for _, _, n in layer_groups(model) if schedule.pipelines(n)]
    return schedule.idle(max(piped)) if piped else schedule.bubble


def describe_pipeline(model: ModelConfig, stages: int) -> str | None:
    """One start-up line: which layer groups are pipelined, their chunk sizes and the idle
    share (bubble and padding); None without pipeline stages."""
    if stages == 1:
        return None
    schedule = pipeline_schedule(model, stages)
    sizes = [n for _, _, n in layer_groups(model)]
    piped = [n for n in sizes if schedule.pipelines(n)]
    largest = max(piped, default=0)
    split = schedule.split(largest) if largest else ()
    chunks = (f"{split[0]} layer{'s' * (split[0] != 1)} per chunk" if len(set(split)) == 1
              else f"chunks of {min(split)}-{max(split)} layers, padding "
              f"{100 * schedule.padding(largest):.1f}%")
    return (f"pipeline: {schedule.kind}, {stages} stages x {schedule.repeats} repeats, "
            f"{schedule.microbatches} microbatches, bubble {100 * schedule.bubble:.1f}% "
            f"(= (P-1)/(V M + P-1)); {sum(piped)} layers pipelined ({chunks}; idle "
            f"{100 * schedule.idle(largest) if largest else 0:.1f}% with the bubble), "
            f"{sum(sizes) - sum(piped)} run on every stage")


def moe_layer_indices(model: ModelConfig) -> list[int]:
    """The model layer index of each row of the [L_moe, ...] metrics: the MoE layers in order,
    then MTP depth k = 1..mtp_depth as layer num_layers + k - 1 when the MTP blocks are MoE
    (they are of the last layer's kind). Empty for a dense model."""
    groups = layer_groups(model)
    rows = [first + j for is_moe, first, n in groups if is_moe for j in range(n)]
    if groups[-1][0]:
        rows += [model.num_layers + k for k in range(model.mtp_depth)]
    return rows
