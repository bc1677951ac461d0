"""TensorBoard event files from metrics records (tensorboardX: no TensorFlow needed).

Tags (docs/observability.md), for any record:
- a scalar: under its key;
- an [L] array: one scalar per entry, `key/layer_NN` (NN the index in the array, two digits);
- a dict of groups: `key/group/layer_NN` for an array, `key/group` for a scalar; a dict keyed
  by layer numbers (`dead_experts` {"<layer>": [expert ids]}): `key/layer_NN` = how many ids;
- an [L, E] array: a histogram of its row per layer, `key/layer_NN`, and for the keys in
  HEATMAPS one image `key/heatmap` (viridis, rows = MoE layers, columns = experts).
Non-finite values (null in metrics.jsonl) and strings are left out; arrays of more than two
dimensions too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from matplotlib import colormaps  # the colour table only: no figure, no pyplot
from tensorboardX import FileWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.summary import histogram, image, scalar

HEATMAPS = ("expert_load_fraction",)  # [L_moe, E] arrays also drawn as an image


@dataclasses.dataclass
class Flat:
    """A record in TensorBoard's terms: tag -> scalar, tag -> values of one histogram,
    key -> 2-D array drawn as a heatmap."""
    scalars: dict[str, float] = dataclasses.field(default_factory=dict)
    histograms: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    heatmaps: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def _layers(tag: str, n: int):
    return [f"{tag}/layer_{i:02d}" for i in range(n)]


def _add(flat: Flat, tag: str, value, top: bool) -> None:
    if isinstance(value, dict):
        if value and all(str(k).isdigit() for k in value):  # {"<layer>": [ids]}: counts
            for k, ids in value.items():
                flat.scalars[f"{tag}/layer_{int(k):02d}"] = float(len(ids))
            return
        for k, v in value.items():
            _add(flat, f"{tag}/{k}", v, top=False)
        return
    if value is None or isinstance(value, str):
        return
    try:
        a = np.asarray(value, dtype=np.float64)  # JSON's null inside a list -> NaN
    except (TypeError, ValueError):
        return
    if a.ndim == 0:
        if np.isfinite(a):
            flat.scalars[tag] = float(a)
    elif a.ndim == 1:
        flat.scalars.update({t: float(v) for t, v in zip(_layers(tag, len(a)), a, strict=True)
                             if np.isfinite(v)})
    elif a.ndim == 2:
        for t, row in zip(_layers(tag, len(a)), a, strict=True):
            if np.isfinite(row).any():
                flat.histograms[t] = row[np.isfinite(row)]
        if top and tag in HEATMAPS:
            flat.heatmaps[tag] = a


def flatten(record: dict) -> Flat:
    """A metrics record (host values, or metrics.jsonl's JSON) -> its tags (module doc)."""
    flat = Flat()
    for key, value in record.items():
        if key != "step":
            _add(flat, key, value, top=True)
    return flat


class Heatmap:
    """Colours an [L, E] array as heatmap pixels (rows: MoE layers, columns: experts; viridis
    over the array's finite min..max, non-finite cells black), each cell a block of pixels
    -> uint8 RGB [H, W, 3]. A colormap lookup, not a drawn figure: matplotlib's canvas took
    ~22 ms of the loop's CPU per logged step, which on a CPU backend the step pays for
    (docs/performance/observability.md, Metric writers). The image's tag names the array and
    step."""

    def __init__(self, target_pixels: int = 512):
        self.target = target_pixels  # the longer side is scaled up to about this

    def __call__(self, values: np.ndarray) -> np.ndarray:
        finite = np.isfinite(values)
        lo = float(values[finite].min()) if finite.any() else 0.0
        hi = max(float(values[finite].max()), lo + 1e-12) if finite.any() else 1.0
        rgb = (colormaps["viridis"](np.clip((np.where(finite, values, lo) - lo) / (hi - lo),
                                            0.0, 1.0))[..., :3] * 255).astype(np.uint8)
        rgb[~finite] = 0
        block = max(1, self.target // max(values.shape))
        return np.repeat(np.repeat(rgb, block, axis=0), block, axis=1)


class TensorBoardWriter:
    """Writes records as event files into `log_dir` (tags: module doc), one event per record
    holding all its values (an event per value costs a queue hand-off each: hundreds per
    record at 671B shapes). Not thread-safe: the loop runs it in a `writers.Background`
    thread."""

    def __init__(self, log_dir: Path, start_step: int = 0):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = FileWriter(str(log_dir), flush_secs=30)
        self.heatmap = Heatmap()
        self.last = start_step
        if start_step:  # resumed: what a killed run logged after its checkpoint is redone
            self._restart(start_step + 1)

    def _restart(self, step: int) -> None:
        """TensorBoard drops the events at `step` and after that earlier files or this one
        hold (a resumed run, a guard rollback): the curves show the steps that count."""
        self.writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))

    def write(self, step: int, record: dict) -> None:
        if step <= self.last:
            self._restart(step)
        self.last = step
        flat = flatten(record)
        values = [v for tag, x in flat.scalars.items() for v in scalar(tag, x).value]
        # numpy's "auto" bins (~sqrt(n)); tensorboardX's default ("tensorflow") has ~10x more
        values += [v for tag, x in flat.histograms.items()
                   for v in histogram(tag, x, bins="auto").value]
        values += [v for key, x in flat.heatmaps.items() for v in image(
            f"{key}/heatmap", self.heatmap(x), dataformats="HWC").value]
        self.writer.add_summary(Summary(value=values), step)

    def close(self) -> None:
        self.writer.close()
