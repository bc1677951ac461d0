"""TensorBoard event files from metrics records (tensorboardX: no TensorFlow needed).

Tags (README "Metrics"), for any record:
- a scalar: under its key;
- an [L] array: one scalar per entry, `key/layer_NN` (NN the index in the array, two digits);
- a dict of groups: `key/group/layer_NN` for an array, `key/group` for a scalar; a dict keyed
  by layer numbers (`dead_experts` {"<layer>": [expert ids]}): `key/layer_NN` = how many ids;
- an [L, E] array: a histogram of its row per layer, `key/layer_NN`, and for the keys in
  HEATMAPS one image `key/heatmap` (matplotlib, rows = MoE layers, columns = experts).
Non-finite values (null in metrics.jsonl) and strings are left out; arrays of more than two
dimensions too.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

# the object-oriented API with the Agg canvas: no pyplot, no GUI backend, safe off the main thread
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
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
    """Draws an [L, E] array as a heatmap (rows: MoE layers, columns: experts, a colour bar)
    -> uint8 RGB pixels [H, W, 3]. Keeps its figure and redraws only the data for an array of
    the same shape (a fresh figure per step costs several times more); one per thread."""

    def __init__(self):
        self._shape, self._canvas, self._image, self._title = None, None, None, None

    def _build(self, values: np.ndarray) -> None:
        rows, cols = self._shape = values.shape
        width, height = 8.0, 1.6 + min(rows, 64) * 0.07  # inches; margins below in inches
        fig = Figure(figsize=(width, height), dpi=80)
        self._canvas = FigureCanvasAgg(fig)
        bottom, plot_h = 0.55 / height, (height - 0.9) / height
        ax = fig.add_axes((0.8 / width, bottom, (width - 2.1) / width, plot_h))
        bar = fig.add_axes(((width - 1.15) / width, bottom, 0.15 / width, plot_h))
        self._image = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis")
        fig.colorbar(self._image, cax=bar)
        ax.set_xlabel(f"expert (of {cols})")
        ax.set_ylabel(f"MoE layer (of {rows})")
        self._title = ax.set_title("", fontsize=10)

    def __call__(self, values: np.ndarray, title: str) -> np.ndarray:
        if values.shape != self._shape:
            self._build(values)
        shown = np.ma.masked_invalid(values)
        self._image.set_data(shown)
        finite = values[np.isfinite(values)]
        if finite.size:
            self._image.set_clim(finite.min(), max(finite.max(), finite.min() + 1e-12))
        self._title.set_text(title)
        self._canvas.draw()
        return np.asarray(self._canvas.buffer_rgba())[..., :3].copy()


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
            f"{key}/heatmap", self.heatmap(x, f"{key}, step {step}"), dataformats="HWC").value]
        self.writer.add_summary(Summary(value=values), step)

    def close(self) -> None:
        self.writer.close()
