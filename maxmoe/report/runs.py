"""Reading run directories for `maxmoe report`: metrics.jsonl, events.jsonl, config.yaml and
plan.json (docs: the observability contract in docs/observability.md).

Every key but `step` is optional, so a run of any maxmoe version renders. What a killed run
leaves (a truncated last line) and lines that are not JSON objects are skipped and named in
`Run.notes`. A step that comes again (a rollback, a resume from an older checkpoint) replaces
what was logged from that step on, so each curve is the trajectory the model actually took.
Arrays ([L] and [L_moe, E]) are kept for at most MAX_SAMPLES logged steps, evenly spaced,
so a 100k-step run of a 671B model fits in memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import yaml

from maxmoe.config import ConfigError
from maxmoe.train.goodput import run_goodput

MAX_SAMPLES = 400  # logged steps kept of each array key: the heatmaps' time axis
MAX_NOTES = 5  # bad lines named one by one per file; the rest are counted


@dataclasses.dataclass
class Series:
    """One key over the logged steps: steps [T] (increasing) and values [T, ...]."""
    steps: np.ndarray
    values: np.ndarray


@dataclasses.dataclass
class Run:
    """What `maxmoe report` shows of one run directory."""
    name: str  # the legend label: the directory's name (parents added to tell runs apart)
    path: Path
    records: int  # valid lines of metrics.jsonl
    scalars: dict[str, Series]  # 0-d keys, every logged step (None/non-finite -> NaN)
    arrays: dict[str, Series]  # [L] / [L_moe, E] keys and dict groups ("key/group"), sampled
    dead_experts: dict[str, list[int]]  # the newest record's `dead_experts`
    dead_since: dict[tuple[str, int], int]  # (layer, expert) -> first step of its dead streak
    events: list[dict]  # events.jsonl: {"step", "kind", "message"}
    config_text: str | None
    config: dict | None  # config.yaml parsed (None when absent or not YAML)
    plan: dict | None
    goodput: dict | None  # train.goodput.run_goodput: buckets over the run's attempts
    notes: list[str]  # what was skipped, one line each


def _is_number(v) -> bool:
    return v is None or (isinstance(v, int | float) and not isinstance(v, str))


def _float(v) -> float:
    return math.nan if v is None else float(v)


def iter_jsonl(path: Path, notes: list[str]) -> Iterator[dict]:
    """The JSON objects of `path`, one a line; other lines are skipped and named in `notes`
    (the last one, when cut off, as a killed run's partial write)."""
    bad: list[str] = []
    with open(path, "rb") as f:  # streamed: a long run's file need not fit in memory twice
        for i, raw in enumerate(f, 1):
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and isinstance(obj.get("step"), int):
                yield obj
            elif raw.strip():
                cut = not raw.endswith(b"\n")  # only the last line can lack its newline
                bad.append(f"line {i} (the last, cut off as a killed run leaves it)" if cut
                           else f"line {i}")
    if bad:
        shown = ", ".join(bad[:MAX_NOTES]) + (f" and {len(bad) - MAX_NOTES} more"
                                              if len(bad) > MAX_NOTES else "")
        notes.append(f"{path}: skipped {shown}: not a JSON object with an integer step")


def _rewound(steps: list[int], values: list) -> tuple[list[int], list]:
    """Keeps, in file order, each step's newest value and drops values a later record of an
    earlier-or-equal step superseded (rollback, resume)."""
    out_s: list[int] = []
    out_v: list = []
    for s, v in zip(steps, values, strict=True):
        while out_s and out_s[-1] >= s:
            out_s.pop()
            out_v.pop()
        out_s.append(s)
        out_v.append(v)
    return out_s, out_v


class _Collector:
    """Accumulates metrics records into per-key step/value lists (scalars every record, arrays
    on sampled records)."""

    def __init__(self, stride: int):
        self.stride = stride
        self.scalars: dict[str, tuple[list, list]] = {}
        self.arrays: dict[str, tuple[list, list]] = {}
        self.dead: dict[str, list[int]] = {}
        self.dead_since: dict[tuple[str, int], int] = {}
        self.count = 0
        self.pending: dict | None = None  # the newest record when it was not sampled

    def finish(self) -> None:
        """Adds the newest record's arrays: the heatmaps end where the run does."""
        if self.pending is not None:
            self.add(0, self.pending, arrays_only=True)

    def _put(self, table: dict, key: str, step: int, value) -> None:
        steps, values = table.setdefault(key, ([], []))
        steps.append(step)
        values.append(value)

    def add(self, index: int, rec: dict, arrays_only: bool = False) -> None:
        """Takes one record: its scalars, and its arrays on every stride-th record (the newest
        record's arrays `finish` adds)."""
        step = rec["step"]
        sampled = arrays_only or index % self.stride == 0
        self.pending = None if sampled else rec
        self.count += not arrays_only
        for key, v in rec.items():
            if key == "step":
                continue
            if key == "dead_experts" and isinstance(v, dict):
                self._dead(step, v)
            elif isinstance(v, dict):
                for group, gv in v.items():
                    self._value(f"{key}/{group}", step, gv, sampled, not arrays_only)
            else:
                self._value(key, step, v, sampled, not arrays_only)

    def _value(self, key: str, step: int, v, sampled: bool, scalars: bool) -> None:
        if _is_number(v):
            if scalars:
                self._put(self.scalars, key, step, _float(v))
        elif isinstance(v, list) and sampled:
            try:
                arr = np.array(v, dtype=np.float32)  # None -> NaN
            except (TypeError, ValueError):
                return  # ragged or not numbers: not a contract array
            self._put(self.arrays, key, step, arr)

    def _dead(self, step: int, dead: dict) -> None:
        now = {(str(layer), int(e)) for layer, ids in dead.items()
               if isinstance(ids, list) for e in ids if isinstance(e, int)}
        self.dead_since = {k: self.dead_since.get(k, step) for k in now}
        self.dead = {}
        for layer, e in sorted(now, key=lambda k: (_layer_order(k[0]), k[1])):
            self.dead.setdefault(layer, []).append(e)

    def series(self, table: dict) -> dict[str, Series]:
        out = {}
        for key, (steps, values) in table.items():
            steps, values = _rewound(steps, values)
            shapes = {np.shape(v) for v in values}
            if len(shapes) > 1:  # the shape changed mid-run (another model): keep the newest
                keep = [i for i, v in enumerate(values) if np.shape(v) == np.shape(values[-1])]
                steps, values = [steps[i] for i in keep], [values[i] for i in keep]
            out[key] = Series(np.asarray(steps), np.asarray(values, dtype=np.float32
                                                            if table is self.arrays else float))
        return out


def _layer_order(layer: str):
    return (0, int(layer)) if layer.isdigit() else (1, layer)


def _line_count(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b"")) + 1
    # (+1: a killed run's last line has no newline; one sample more or less does not matter)


def read_metrics(path: Path, notes: list[str]) -> _Collector:
    """metrics.jsonl into a _Collector (arrays sampled to at most MAX_SAMPLES records)."""
    collector = _Collector(max(1, math.ceil(_line_count(path) / MAX_SAMPLES)))
    for i, rec in enumerate(iter_jsonl(path, notes)):
        collector.add(i, rec)
    collector.finish()
    return collector


def read_events(path: Path, notes: list[str]) -> list[dict]:
    """events.jsonl's events, sorted by step; [] when the file is absent."""
    if not path.is_file():
        return []
    events = [{"step": e["step"], "kind": str(e.get("kind", "warning")),
               "message": str(e.get("message", ""))} for e in iter_jsonl(path, notes)]
    return sorted(events, key=lambda e: e["step"])


def _optional_text(path: Path) -> str | None:
    return path.read_text(errors="replace") if path.is_file() else None


def _load_yaml(text: str | None, path: Path, notes: list[str]) -> dict | None:
    if text is None:
        return None
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        notes.append(f"{path}: not valid YAML; shown as text only")
        return None
    return parsed if isinstance(parsed, dict) else None


def _load_plan(path: Path, notes: list[str]) -> dict | None:
    if not path.is_file():
        return None
    try:
        plan = json.loads(path.read_text())
    except ValueError:
        notes.append(f"{path}: not valid JSON (a killed write?); the plan is left out")
        return None
    return plan if isinstance(plan, dict) else None


def check_run_dir(path: Path) -> None:
    """Raises ConfigError (one line) unless `path` is a directory."""
    if not path.exists():
        raise ConfigError(f"report: run dir '{path}' does not exist; pass the run.dir of a "
                          "`maxmoe train` run (the folder holding metrics.jsonl)")
    if not path.is_dir():
        raise ConfigError(f"report: '{path}' is a file, not a run directory; pass its folder "
                          f"('{path.parent}') or another run.dir")


def load_run(path: Path, name: str | None = None) -> Run | None:
    """The run in directory `path`, or None when it has no metrics.jsonl or no valid record
    in it (load_runs says which). Raises ConfigError when `path` is not a directory."""
    check_run_dir(path)
    notes: list[str] = []
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        return None
    collector = read_metrics(metrics, notes)
    if collector.count == 0:
        return None
    config_text = _optional_text(path / "config.yaml")
    return Run(name=name or path.resolve().name, path=path, records=collector.count,
               scalars=collector.series(collector.scalars),
               arrays=collector.series(collector.arrays), dead_experts=collector.dead,
               dead_since=collector.dead_since,
               events=read_events(path / "events.jsonl", notes), config_text=config_text,
               config=_load_yaml(config_text, path / "config.yaml", notes),
               plan=_load_plan(path / "plan.json", notes), goodput=run_goodput(path),
               notes=notes)


def run_names(paths: list[Path]) -> list[str]:
    """Legend labels: each directory's name, with as many parent names as it takes to tell
    two runs apart (runs/a/tiny and runs/b/tiny -> a/tiny, b/tiny)."""
    parts = [p.resolve().parts for p in paths]
    depth = 1
    while depth < max(len(p) for p in parts):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
        depth += 1
    return ["/".join(p[-depth:]) for p in parts]


def load_runs(paths: list[Path]) -> tuple[list[Run], list[str]]:
    """The runs of `paths` that have metrics, and notes naming the ones left out (and why) and
    the lines skipped. Raises ConfigError when a path is not a directory or no run has metrics."""
    for path in paths:
        check_run_dir(path)
    runs, notes = [], []
    for path, name in zip(paths, run_names(paths), strict=True):
        run = load_run(path, name)
        if run is None:
            why = ("has no metrics.jsonl" if not (path / "metrics.jsonl").is_file()
                   else "has no complete record in metrics.jsonl")
            notes.append(f"{path}: left out: it {why} (not a run dir, or killed before the "
                         "first logged step)")
            continue
        runs.append(run)
        notes += run.notes
    if not runs:
        raise ConfigError(f"report: nothing to show: {'; '.join(notes)}; pass the run.dir of a "
                          "`maxmoe train` run that logged at least one step")
    return runs, notes
