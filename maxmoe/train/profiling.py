"""The profiling window of `maxmoe train`: logging.profile_start=N logging.profile_steps=K traces
steps N .. N+K-1 (1-based) with jax.profiler into <run.dir>/profile, then prints where their
time went per model part, the table `maxmoe bench --profile` prints (metrics/profile.py).

Two integer keys, not one `N:K` string: YAML 1.1 reads `10:20` as the base-60 integer 620.

Whole steps: the loop dispatches step N before it has read step N-1's metrics (loop.py), so the
window waits for step N-1's state before it starts tracing and for step N+K-1's outputs before
it stops. What the window holds is the real loop: the host's guard and logging work on step
N-1 .. N+K-2 happens while the device runs the next, and a logged step (1 in
logging.every_steps) also computes the update ratios and the param norm.

Files (every process traces its own host; process 0 reads the trace and writes the rest):
  profile/plugins/profile/<time>/<host>.xplane.pb    the trace (TensorBoard's profile plugin,
                                                     XProf: `xprof --logdir <run.dir>/profile`)
  profile/plugins/profile/<time>/<host>.trace.json.gz the same as Chrome trace events
                                                     (Perfetto's ui.perfetto.dev opens it)
  profile/train_step.hlo.txt                         the step's compiled HLO (op names)
  profile/breakdown.json                             the per-part table as JSON
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import jax

from maxmoe.config import Config
from maxmoe.metrics.profile import breakdown, table


class ProfileWindow:
    """`before(step, state)` ahead of dispatching each step and `after(step, outputs)` after
    it; `close()` when the loop ends (stops a trace cut short by SIGTERM or a guard)."""

    def __init__(self, start: int, steps: int, directory: Path, log: Callable[[str], None]):
        self.start, self.steps, self.end = start, steps, start + steps - 1
        self.directory, self.log = Path(directory), log
        self.compiled = None  # the step's executable (loop.compile_first): its HLO op names
        self.tracing = self.finished = False

    @classmethod
    def from_config(cls, cfg: Config, run_dir: Path, first_step: int,
                    log: Callable[[str], None]) -> ProfileWindow | None:
        """The window of cfg.logging, or None when it is off or, on resume, already passed
        (first_step: the first step this process runs, 1-based)."""
        start, steps = cfg.logging.profile_start, cfg.logging.profile_steps
        if not start:
            return None
        if first_step > start:
            log(f"profile: steps {start}-{start + steps - 1} were run before this resume at "
                f"step {first_step}; not traced (raise logging.profile_start)")
            return None
        return cls(start, steps, run_dir / "profile", log)

    def before(self, step: int, state) -> bool:
        """At the window's first step: waits for the previous step (its state), starts
        tracing and returns True; else does nothing and returns False."""
        if step != self.start or self.tracing or self.finished:
            return False
        jax.block_until_ready(state)
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory))
        self.tracing = True
        return True

    def after(self, step: int, outputs) -> float | None:
        """At the window's last step: waits for its outputs, stops tracing, (process 0) prints
        the breakdown and returns the seconds that took beyond the wait, which are not training
        time (the loop keeps them out of tokens/s); else None."""
        if not self.tracing or step < self.end:
            return None
        jax.block_until_ready(outputs)
        t = time.perf_counter()
        self.close()
        self.finished = True
        if jax.process_index() == 0:
            self.report()
        return time.perf_counter() - t

    def report(self) -> dict:
        """Reads the newest trace back, writes the HLO text and breakdown.json, logs the table."""
        hlo = self.compiled.as_text()
        (self.directory / "train_step.hlo.txt").write_text(hlo)
        parts = breakdown(self.directory, hlo, self.steps)
        (self.directory / "breakdown.json").write_text(json.dumps(parts, indent=1))
        self.log(f"profile: steps {self.start}-{self.end} traced into {self.directory} "
                 "(TensorBoard/XProf: *.xplane.pb, Perfetto: *.trace.json.gz); time per step "
                 f"by part:\n{table(parts)}")
        return parts

    def close(self) -> None:
        """Stops a running trace (its files stay; no breakdown)."""
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
