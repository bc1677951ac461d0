"""Goodput: where a run's wall time went, across the restarts of one run directory.

Each attempt (one `maxmoe train` process) times its own buckets:
- startup: from the process's start (`maxmoe train` passes it; else the call of `train`) to
  the loop's first compile: imports, the distributed join, checks, tokenizer, restore;
- compile: the first step's lowering and compilation;
- data_wait: blocked on the next batch;
- productive: the rest of each loop iteration that advanced the run past any step it had
  finished before (in this attempt or an earlier one);
- redone: the same, for steps finished before (after a kill, a preemption that lost steps,
  or a guard's rollback);
- checkpoint: the time saves block the loop;
- eval: the evaluation hook;
- idle: the remainder of the attempt's wall time (plan.json, shutdown, logging between steps).

Process 0 keeps each attempt's figures in <run.dir>/goodput/<start>.json, rewritten at every
logging window and at the end, so a killed attempt leaves its last window's. `run_goodput`
adds the attempts up; the downtime between one attempt's last write and the next one's start
counts too (the run dir shows it), as `down`. goodput = productive / (wall + down).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

BUCKETS = ("startup", "compile", "data_wait", "productive", "redone", "checkpoint", "eval")
GOODPUT_DIR = "goodput"


class Goodput:
    """One attempt's buckets (seconds). `add` charges a bucket; `lap` closes a loop iteration,
    charging what its other buckets did not take to productive or redone."""

    def __init__(self, run_dir: Path | None, started: float):
        self.path = None
        self.started = started  # epoch seconds
        self.seconds = dict.fromkeys(BUCKETS, 0.0)
        self.reached = 0  # the highest step finished by this run so far (any attempt)
        if run_dir is not None:
            earlier = attempts(run_dir)
            self.reached = max((a["reached"] for a in earlier), default=0)
            self.path = run_dir / GOODPUT_DIR / f"{self.started:.3f}.json"
        self._lap = None  # (perf_counter, the other buckets' total) at the last lap

    def add(self, bucket: str, seconds: float) -> None:
        self.seconds[bucket] += seconds

    def lap(self, step: int, wasted: bool = False) -> None:
        """Ends a loop iteration that worked on `step`: its time, less the other buckets'
        share of it, is productive when the step is new to the run, else redone (`wasted`:
        its work was dropped, e.g. by a rollback)."""
        now, others = time.perf_counter(), self._others()
        if self._lap is not None:
            began, others_then, reached_then = self._lap
            new = step > reached_then and not wasted  # as the run stood when it began
            self.add("productive" if new else "redone", max(now - began - (others - others_then),
                                                          0.0))
        self._lap = (now, others, self.reached)

    def finished(self, step: int) -> None:
        """A step was finished (settled): later work on it or before it is redone."""
        self.reached = max(self.reached, step)

    def _others(self) -> float:
        return sum(v for k, v in self.seconds.items() if k not in ("productive", "redone"))

    def record(self) -> dict:
        """This attempt's figures: start and last update (epoch seconds), wall, buckets, idle."""
        now = time.time()
        wall = now - self.started
        busy = sum(self.seconds.values())
        return {"started": self.started, "updated": now, "reached": self.reached,
                "wall_s": wall, **{f"{k}_s": v for k, v in self.seconds.items()},
                "idle_s": max(wall - busy, 0.0)}

    def save(self) -> None:
        """Writes this attempt's record (process 0 passes a run_dir; others keep none)."""
        if self.path is None:
            return
        self.path.parent.mkdir(exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record()) + "\n")
        os.replace(tmp, self.path)  # a reader never sees half a file


def attempts(run_dir: Path) -> list[dict]:
    """Every attempt's last record in run_dir, oldest first."""
    folder = Path(run_dir) / GOODPUT_DIR
    found = [json.loads(p.read_text()) for p in folder.glob("*.json")] if folder.is_dir() else []
    return sorted(found, key=lambda a: a["started"])


def run_goodput(run_dir: Path) -> dict | None:
    """The run's buckets added up over its attempts, `down` (the gaps between them), wall
    (their walls plus down) and goodput = productive / wall; None before any attempt."""
    found = attempts(run_dir)
    if not found:
        return None
    total = {f"{k}_s": sum(a[f"{k}_s"] for a in found) for k in (*BUCKETS, "idle")}
    down = sum(max(b["started"] - a["updated"], 0.0) for a, b in itertools.pairwise(found))
    wall = sum(a["wall_s"] for a in found) + down
    return {"goodput": total["productive_s"] / wall if wall > 0 else 0.0, "wall_s": wall,
            "attempts": len(found), **total, "down_s": down}


def goodput_summary(run_dir: Path, goodput: Goodput) -> dict:
    """The train summary's `goodput` (the run's, over its attempts, from process 0's files;
    this attempt's alone where there are none) and `goodput_time_s`, its buckets rounded."""
    totals = run_goodput(run_dir) if goodput.path is not None else None
    if totals is None:
        record = goodput.record()
        totals = {**record, "goodput": record["productive_s"] / record["wall_s"]
                  if record["wall_s"] > 0 else 0.0}
    buckets = {k[:-2]: round(totals[k], 1) for k in
               (*(f"{b}_s" for b in BUCKETS), "idle_s", "down_s", "wall_s") if k in totals}
    return {"goodput": round(totals["goodput"], 4), "goodput_time_s": buckets}
