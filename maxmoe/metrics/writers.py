"""Where metrics go: metrics.jsonl (the source of truth, one object per logged step) and the
`Background` thread that TensorBoard and W&B write from (metrics/tensorboard.py,
metrics/wandb_writer.py), so the loop only hands them a record. Only process 0 writes."""

from __future__ import annotations

import json
import math
import queue
import sys
import threading
from pathlib import Path
from typing import Protocol

import numpy as np


def plain(v):
    """A record value as JSON: numbers as int / float (non-finite -> None; float32 values as
    their shortest float32 decimal), arrays as nested lists, dicts with string keys,
    recursively; anything else (strings, None) unchanged."""
    if isinstance(v, dict):
        return {str(k): plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, np.ndarray) or hasattr(v, "__array__"):  # numpy / jax arrays and scalars
        a = np.asarray(v)
        if a.dtype in (np.float32, np.float16) or a.dtype.name == "bfloat16":
            # each value's shortest decimal that reads back as the same float32 (a float32
            # made float64 prints up to 17 digits): exact, and ~40% less JSON per array
            a = a.astype(np.float32).astype(str).astype(np.float64)
        return plain(a.tolist()) if a.ndim else plain(a.item())
    if isinstance(v, bool):  # a flag (skipped, spike) as 0.0 / 1.0, as the step computes it
        return float(v)
    if isinstance(v, float) or (hasattr(v, "__float__") and not isinstance(v, int)):
        v = float(v)
        return v if math.isfinite(v) else None
    return v


class MetricsWriter:
    """metrics.jsonl: one JSON object {"step": N, ...record} per logged step, appended and
    flushed at once (a killed run loses at most a truncated last line). `enabled` False (every
    process but 0): writes nothing."""

    def __init__(self, run_dir: Path, *, enabled: bool):
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None

    def write(self, step: int, record: dict) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps({"step": step, **plain(record)}) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class Sink(Protocol):
    def write(self, step: int, record: dict) -> None: ...
    def close(self) -> None: ...


_DONE = object()


class Background:
    """Runs `sink.write(step, record)` in one worker thread, in step order, so a slow sink
    (histograms, a heatmap PNG, W&B) does not hold up the loop; the loop only enqueues.

    At most `depth` records wait: a sink slower than the steps then blocks the loop rather
    than grow without bound. A sink that raises is reported once on stderr (with the step) and
    gets no more records; training goes on, since metrics.jsonl still has every record.
    `close()` writes what is queued, then closes the sink.
    """

    def __init__(self, sink: Sink, name: str, depth: int = 16):
        self.sink, self.name, self.failed = sink, name, False
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._work, name=f"maxmoe-{name}", daemon=True)
        self._thread.start()

    def write(self, step: int, record: dict) -> None:
        if not self.failed:
            self._queue.put((step, record))

    def _work(self) -> None:
        while (item := self._queue.get()) is not _DONE:
            if self.failed:
                continue
            try:
                self.sink.write(*item)
            except Exception as error:  # noqa: BLE001 - any sink failure: warn, keep training
                self.failed = True
                print(f"warning: the {self.name} writer failed at step {item[0]} "
                      f"({type(error).__name__}: {error}); it writes nothing more this run "
                      "(metrics.jsonl has every record)", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._queue.put(_DONE)
        self._thread.join()
        self.sink.close()
