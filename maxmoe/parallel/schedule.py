"""The pipeline schedule: which stage runs which layers in which pass, and what idles.

A plain description derived from the model config (parallel/pipeline.py runs it; model/spec.py
and the planner read its bubble and padding), so it imports only config.
P stages, V repeats, M microbatches.
"""

from __future__ import annotations

import dataclasses

from maxmoe.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A GPipe (V = 1) or circular (V > 1, M >= P) schedule over P stages.

    A pipelined group of L layers is cut into C = P V chunks in layer order; chunk c = v P + p
    runs on stage p in pass v. Chunks may be unequal (`chunk_layers`, else as even as
    possible): each stage then runs `slots` = the largest chunk's layers per pass, the shorter
    chunks padded with masked identity slots. Padding costs, per stage, the compute of the
    missing layers (they run and are discarded: under the stage vmap no branch is skipped)
    and a zero copy of their weights in the step's regrouped weights (a temporary: the stored
    params stay L layers in natural order)."""
    kind: str  # model.pipeline_schedule: gpipe | circular
    stages: int  # P
    repeats: int  # V: chunks of a pipelined group per stage
    microbatches: int  # M
    chunk_layers: tuple[int, ...] = ()  # model.pipeline_stage_layers; () = as even as possible

    @property
    def chunks(self) -> int:
        return self.stages * self.repeats

    def pipelines(self, layers: int) -> bool:
        """Whether a group of `layers` layers is pipelined: every chunk gets a layer, and an
        explicit split sums to it. Other groups (e.g. a first dense layer) run on every stage
        with replicated work."""
        if self.stages == 1 or layers < self.chunks:
            return False
        return not self.chunk_layers or sum(self.chunk_layers) == layers

    def split(self, layers: int) -> tuple[int, ...]:
        """Layers of each chunk c = v P + p of a pipelined group, in layer order."""
        if self.chunk_layers:
            return self.chunk_layers
        base, extra = divmod(layers, self.chunks)  # the remainder: one more on the last chunks
        return tuple(base + (c >= self.chunks - extra) for c in range(self.chunks))

    def slots(self, layers: int) -> int:
        """Layer slots each stage runs per pass: the largest chunk."""
        return max(self.split(layers))

    def slot_table(self, layers: int) -> list[list[int]]:
        """[P][V * slots]: the natural layer index in each stage's slot (pass v, slot k at
        v * slots + k), -1 for a padding slot."""
        sizes, n = self.split(layers), self.slots(layers)
        starts = [sum(sizes[:c]) for c in range(self.chunks)]
        return [[starts[v * self.stages + p] + k if k < sizes[v * self.stages + p] else -1
                 for v in range(self.repeats) for k in range(n)] for p in range(self.stages)]

    @property
    def iterations(self) -> int:
        """Steps of the schedule: each microbatch passes V times, the last stage lags P - 1."""
        return self.repeats * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """Idle fraction of each stage, (P-1) / (V M + P-1)."""
        return (self.stages - 1) / self.iterations

    def padding(self, layers: int) -> float:
        """Share of the busy layer slots that are padding: 1 - L / (P V slots)."""
        return 1 - layers / (self.chunks * self.slots(layers))

    def idle(self, layers: int) -> float:
        """Share of all stage-layer slots doing no work, bubble and padding together:
        1 - M L / ((V M + P-1) P slots) = 1 - (1 - bubble)(1 - padding)."""
        return 1 - (1 - self.bubble) * (1 - self.padding(layers))


def pipeline_schedule(model: ModelConfig, stages: int) -> PipelineSchedule:
    """The schedule of `stages` pipeline stages (1: none) as the model config sets it."""
    repeats = model.pipeline_repeats if model.pipeline_schedule == "circular" else 1
    microbatches = model.pipeline_microbatches or stages
    return PipelineSchedule(model.pipeline_schedule, stages, repeats, microbatches,
                            tuple(model.pipeline_stage_layers))
