"""Facts derived from the model config alone: the runs of same-kind layers (each one stacked
and scanned) and the pipeline schedule. Config checks, FLOP counts, conversion and start-up
lines read them here, so they need not import the model (this file imports only config).

P stages, V repeats, M microbatches (parallel/pipeline.py runs the schedule).
"""

from __future__ import annotations

import dataclasses

from maxmoe.config import ModelConfig


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


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A GPipe (V = 1) or circular (V > 1, M = P) schedule over P stages."""
    kind: str  # model.pipeline_schedule: gpipe | circular
    stages: int  # P
    repeats: int  # V: chunks of a pipelined group per stage
    microbatches: int  # M

    def pipelines(self, layers: int) -> bool:
        """Whether a group of `layers` layers is pipelined: the stages x repeats divide it.
        Other groups (e.g. a first dense layer) run on every stage with replicated work."""
        return self.stages > 1 and layers % (self.stages * self.repeats) == 0

    @property
    def iterations(self) -> int:
        """Steps of the schedule: each microbatch passes V times, the last stage lags P - 1."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Idle fraction of each stage, (P-1) / (V M + P-1)."""
        return (self.stages - 1) / self.iterations


def pipeline_schedule(model: ModelConfig, stages: int) -> PipelineSchedule:
    """The schedule of `stages` pipeline stages (1: none) as the model config sets it."""
    repeats = model.pipeline_repeats if model.pipeline_schedule == "circular" else 1
    microbatches = stages if repeats > 1 else (model.pipeline_microbatches or stages)
    return PipelineSchedule(model.pipeline_schedule, stages, repeats, microbatches)


def describe_pipeline(model: ModelConfig, stages: int) -> str | None:
    """One start-up line: which layer groups are pipelined and the schedule's bubble; None
    without pipeline stages."""
    if stages == 1:
        return None
    schedule = pipeline_schedule(model, stages)
    sizes = [n for _, _, n in layer_groups(model)]
    piped = sum(n for n in sizes if schedule.pipelines(n))
    return (f"pipeline: {schedule.kind}, {stages} stages x {schedule.repeats} repeats, "
            f"{schedule.microbatches} microbatches, bubble {100 * schedule.bubble:.1f}% "
            f"(= (P-1)/(V M + P-1)); {piped} layers pipelined, {sum(sizes) - piped} run on "
            "every stage")
