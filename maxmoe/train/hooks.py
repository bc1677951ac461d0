"""What the training loop hands its hooks: the logging window (`LogWindow`: steps, time and host
costs between two logged steps, closed into a metrics.jsonl record), a finished step
(`StepEnd`) and the hooks themselves (`Hook`: a function on a `every=N` cadence)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from maxmoe.metrics.host import HostTiming
from maxmoe.metrics.layers import layer_record
from maxmoe.model.spec import moe_layer_indices
from maxmoe.train.setup import RunSetup
from maxmoe.train.step import DIAGNOSTICS


@dataclasses.dataclass
class LogWindow:
    """What accumulates between two logged steps: how many steps, since when, the time spent
    on other work (evaluation), and the host's waits and CPU (`timing`). `close` turns it into
    the record metrics.jsonl gets; the run's first step compiles, so a window starts at its end."""
    setup: RunSetup
    peak: float | None  # FLOP/s of all devices, for MFU; None: MFU left out (no known peak)
    timing: HostTiming
    started: float | None = None  # perf_counter at the start; None until the first step ended
    steps: int = 0  # steps counted since `started`
    excluded_s: float = 0.0  # not training time (evaluation): kept out of tokens/s
    last: dict | None = None  # the newest closed record

    def count(self) -> bool:
        """Counts one finished step; True if it was the run's first (the window starts now)."""
        if self.started is None:
            self.started = time.perf_counter()
            self.timing.reset()
            return True
        self.steps += 1
        return False

    def close(self, host: dict, extra: dict) -> dict:
        """The record of the step whose host metrics are `host` (plus hooks' `extra`, e.g. the
        eval loss): its scalars, the per-layer arrays of docs/observability.md (metrics/layers.py)
        and tokens/s, MFU and host costs over the window; starts the next one."""
        steps, tokens = self.steps, self.setup.tokens_per_step
        elapsed = time.perf_counter() - self.started - self.excluded_s
        tps = tokens * steps / elapsed if steps else 0.0
        self.started, self.steps, self.excluded_s = time.perf_counter(), 0, 0.0
        # a step cut short by SIGTERM has no DIAGNOSTICS (NaN): left out, not written as NaN
        rec = {k: v for k, v in host.items() if not isinstance(v, dict) and np.ndim(v) == 0
               and not (k in DIAGNOSTICS and np.isnan(v))}
        cfg = self.setup.cfg
        rec.update(layer_record(host, per_layer=cfg.logging.per_layer,
                                dead_windows=cfg.guard.dead_expert_windows,
                                layers=moe_layer_indices(cfg.model), logged_only=DIAGNOSTICS))
        rec.setdefault("activation_rms_max",  # all layers, from the step (guards)
                       float(np.max(host.get("activation_rms", 0.0))))
        rec.update(tokens_per_second=tps, step_time_s=tokens / tps if tps else None)
        if self.peak is not None:
            rec["mfu"] = tps / tokens * self.setup.model_flops / self.peak
        if steps:
            rec.update(self.timing.window(steps, elapsed))
        else:  # the first step's own record: the next window's host costs start now
            self.timing.reset()
        rec.update(extra)
        self.last = rec
        return rec


@dataclasses.dataclass
class StepEnd:
    """What a hook sees of a finished step (after the guards cleared it)."""
    step: int  # steps done so far (1-based)
    last: bool  # the run's last step: train.steps, or the step a SIGTERM stops after
    host: dict  # the step's metrics on the host
    window: LogWindow
    state: Any = None  # the train state after the step; None when read one step late
    extra: dict = dataclasses.field(default_factory=dict)  # hooks' metrics (eval loss) to log
    _record: dict | None = dataclasses.field(default=None, init=False, repr=False)

    def record(self) -> dict:
        """The logged record of this step (closes the logging window on the first call)."""
        if self._record is None:
            self._record = self.window.close(self.host, self.extra)
        return self._record


@dataclasses.dataclass(frozen=True)
class Hook:
    """`fn(event: StepEnd)` after step N when N % every == 0, and after the run's last step if
    `at_end` (levanter's cadence); hooks run in the order they are registered.

    reads_state: it needs the step's state (save, eval): the loop settles such a step at once
    instead of one step late. writes: a metrics writer; it also runs at a step where an earlier
    hook added metrics (`event.extra`, the eval loss), so they reach every writer. A new writer
    (TensorBoard, W&B) is one more `Hook(cfg.logging.every_steps, fn, at_end=True, writes=True)`.
    """
    every: int  # 0: no cadence
    fn: Callable[[StepEnd], None]
    at_end: bool = False
    reads_state: bool = False
    writes: bool = False

    def due(self, step: int, last: bool, extra: bool = False) -> bool:
        return ((self.every > 0 and step % self.every == 0) or (self.at_end and last)
                or (self.writes and extra))
