"""The report page: one self-contained HTML file (inline CSS, inline SVG and base64 PNG figures;
no scripts, no network) of one or more run directories.

Expert load at 671B scale (59 MoE layers x 256 experts): one overview image of every layer's
max/mean load over time, then one small heatmap per layer (experts x steps, a shared color
scale) in a grid that wraps to the window's width, each layer's dead experts marked at its
right edge and listed in a table.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

import numpy as np

from maxmoe.config import ConfigError, ModelConfig
from maxmoe.model.spec import moe_layer_indices
from maxmoe.report import figures
from maxmoe.report.runs import Run, Series, load_runs
from maxmoe.train.goodput import BUCKETS

LOSS = [("loss (train: solid; eval: dashed)", ["loss", "eval_loss"], False)]
OPTIMIZATION = [("learning rate", ["learning_rate"], False), ("grad norm", ["grad_norm"], True),
                ("loss scale", ["loss_scale"], True)]
THROUGHPUT = [("tokens/s", ["tokens_per_second"], False), ("MFU", ["mfu"], False)]
SHOWN = {k for panels in (LOSS, OPTIMIZATION, THROUGHPUT) for _, keys, _ in panels for k in keys}
MAX_EVENT_ROWS = 200  # per run; the rest are counted
CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; max-width: 1400px; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
td, th { border: 1px solid #ddd; padding: 0.2em 0.6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.notes { background: #fff4e0; border-left: 4px solid #e69500; padding: 0.4em 1em; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(330px, 1fr));
        gap: 0.4em; }
.grid img, .wide { max-width: 100%; } svg { max-width: 100%; height: auto; }
pre { background: #f7f7f7; padding: 0.8em; overflow-x: auto; font-size: 0.85em; }
.muted { color: #777; }
"""


def esc(value) -> str:
    return html.escape(str(value))


def fmt(value) -> str:
    """A number for a table cell: 4 significant digits, or as it is."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.4g}"
    return "n/a" if value is None else esc(value)


class Raw(str):
    """A table cell that is HTML already (not escaped)."""


def table(header: list[str], rows: list[list]) -> str:
    """An HTML table; cells are escaped (numbers right-aligned)."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(
        f"<td class=num>{fmt(c)}</td>" if isinstance(c, int | float) and not isinstance(c, bool)
        else f"<td>{c if isinstance(c, Raw) else fmt(c)}</td>"
        for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def img(uri: str, alt: str, cls: str = "") -> str:
    return f'<img src="{uri}" alt="{esc(alt)}"' + (f' class="{cls}"' if cls else "") + ">"


def _last(run: Run, key: str):
    s = run.scalars.get(key)
    if s is None:
        return None
    finite = s.values[np.isfinite(s.values)]
    return float(finite[-1]) if len(finite) else None


def summary_section(runs: list[Run]) -> str:
    """The runs table: where, how far, last figures, events."""
    rows = []
    for i, run in enumerate(runs):
        steps = run.scalars["loss"].steps if "loss" in run.scalars else None
        eval_loss = run.scalars.get("eval_loss")
        best_eval = (float(np.nanmin(eval_loss.values)) if eval_loss is not None
                     and np.isfinite(eval_loss.values).any() else None)
        skips = figures.event_steps(run).get("skip", [])
        rows.append([Raw(f'<span style="color:{figures.run_hex(i)}">&#9632;</span> '
                         f"{esc(run.name)}"),
                     str(run.path), run.records,
                     f"{steps[0]}-{steps[-1]}" if steps is not None and len(steps) else "n/a",
                     _last(run, "loss"), best_eval, _last(run, "tokens_per_second"),
                     _last(run, "mfu"), len(run.events), len(skips)])
    return table(["run", "dir", "logged steps", "steps", "last loss", "best eval loss",
                  "last tokens/s", "last MFU", "events", "skip marks"], rows)


def notes_section(notes: list[str]) -> str:
    if not notes:
        return ""
    items = "".join(f"<li>{esc(n)}</li>" for n in notes)
    return f'<div class="notes"><b>Skipped input</b><ul>{items}</ul></div>'


def curves_section(runs: list[Run]) -> str:
    """Loss, optimization and throughput curves, then every other logged scalar (folded)."""
    parts = [figures.curves_svg(runs, LOSS, columns=1, panel_width=9.0),
             figures.curves_svg(runs, OPTIMIZATION), figures.curves_svg(runs, THROUGHPUT)]
    others = sorted({k for r in runs for k in r.scalars} - SHOWN - {"step"})
    if others:
        panels = [(k, [k], False) for k in others]
        parts.append(f"<details><summary>every other logged scalar ({len(others)})</summary>"
                     f"{figures.curves_svg(runs, panels, columns=4, panel_width=3.4)}</details>")
    return "<h2>Curves</h2>" + "".join(parts)


def events_section(runs: list[Run]) -> str:
    """Each run's events.jsonl as a table (the first MAX_EVENT_ROWS)."""
    out = ["<h2>Guard events</h2><p class=muted>Marked on every curve along its top edge "
           "(one row of markers per run; shapes in the legends). Skipped updates are read from "
           "the metrics too (<code>skipped</code>, <code>skipped_steps</code>): those mark the "
           "logged step whose window had them.</p>"]
    for run in runs:
        if not run.events:
            out.append(f"<p>{esc(run.name)}: no events.jsonl entries.</p>")
            continue
        rows = [[e["step"], e["kind"], e["message"]] for e in run.events[:MAX_EVENT_ROWS]]
        more = len(run.events) - len(rows)
        out.append(f"<h3>{esc(run.name)}</h3>" + table(["step", "kind", "message"], rows)
                   + (f"<p>and {more} more events</p>" if more > 0 else ""))
    return "".join(out)


def _moe_layers(run: Run, rows: int) -> list[int]:
    """The model layer of each L_moe row (`model.spec.moe_layer_indices` of the run's config:
    MoE layers in order, then MTP's); row numbers when config.yaml does not give `rows`."""
    try:
        layers = moe_layer_indices(ModelConfig(**(run.config or {})["model"]))
    except (KeyError, TypeError, ValueError, IndexError):  # no config, or not this version's
        layers = []
    return layers if len(layers) == rows else list(range(rows))


def _moe_labels(run: Run, rows: int) -> list[str]:
    """Names of the L_moe rows: 'layer i' (the model's layer index, as `dead_experts` keys
    name it), 'MTP d' for the multi-token-prediction depths."""
    model = (run.config or {}).get("model") or {}
    num_layers = model.get("num_layers") if isinstance(model.get("num_layers"), int) else None
    return [f"MTP {i - num_layers + 1}" if num_layers is not None and i >= num_layers
            else f"layer {i}" for i in _moe_layers(run, rows)]


def _dead_table(run: Run) -> str:
    if not run.dead_experts:
        known = "dead_expert_count" in run.scalars  # the run counts them: none is news
        return "<p>Dead experts: none at the last logged step.</p>" if known else ""
    rows = [[layer, ", ".join(map(str, ids)), len(ids),
             min(run.dead_since.get((layer, e), 0) for e in ids)]
            for layer, ids in run.dead_experts.items()]
    return ("<p>Dead experts at the last logged step (no tokens for "
            "<code>guard.dead_expert_windows</code> logging windows):</p>"
            + table(["layer (as logged)", "experts", "count", "reported dead since step"], rows))


def load_section(run: Run) -> str:
    """One run's expert-load overview, per-layer heatmap grid and dead experts."""
    load = run.arrays.get("expert_load_fraction")
    if load is None or load.values.ndim != 3:
        return (f"<h3>{esc(run.name)}</h3><p>No <code>expert_load_fraction</code> [L_moe, E] in "
                "metrics.jsonl (written by maxmoe versions with per-layer metrics).</p>"
                + _dead_table(run))
    experts = load.values.shape[2]
    labels = _moe_labels(run, load.values.shape[1])
    ratio = Series(load.steps, np.nan_to_num(load.values).max(axis=2) * experts)  # max/mean
    overview = figures.layer_time_uri(ratio, "max / mean expert load per MoE layer "
                                      "(1 = balanced)", "MoE layer", cmap="magma", vmin=1.0)
    dead_by_row = _dead_rows(run, labels)
    panels = [img(figures.load_panel_uri(load.steps, load.values[:, i, :],
                                         label + (f": {len(dead_by_row[i])} dead"
                                                  if dead_by_row[i] else ""), dead_by_row[i]),
                  f"expert load, {label}") for i, label in enumerate(labels)]
    return (f"<h3>{esc(run.name)}</h3>{img(overview, 'max/mean load', 'wide')}"
            f"<p>{img(figures.load_colorbar_uri(), 'color scale')}</p>"
            f"<div class=grid>{''.join(panels)}</div>{_dead_table(run)}")


def _dead_rows(run: Run, labels: list[str]) -> list[list[int]]:
    """dead_experts (keyed by model layer index) mapped onto the L_moe rows."""
    row_of = {layer: row for row, layer in enumerate(_moe_layers(run, len(labels)))}
    rows: list[list[int]] = [[] for _ in labels]
    for layer, ids in run.dead_experts.items():
        if layer.isdigit() and int(layer) in row_of:
            rows[row_of[int(layer)]] = list(ids)
    return rows


def layers_section(runs: list[Run]) -> str:
    """Every other array key: [L] keys as layer x step images, [L, E] keys at the last logged
    step as layer x expert images (folded)."""
    out = []
    for run in runs:
        for key, s in sorted(run.arrays.items()):
            if key == "expert_load_fraction" or not len(s.steps):
                continue
            if s.values.ndim == 2:
                out.append(img(figures.layer_time_uri(s, f"{run.name}: {key}", "layer"), key,
                               "wide"))
            elif s.values.ndim == 3:
                out.append(img(figures.matrix_uri(s.values[-1], f"{run.name}: {key} at step "
                                                  f"{s.steps[-1]}", "expert", "layer",
                                                  cmap="coolwarm"), key, "wide"))
    if not out:
        return ""
    return (f"<h2>Per-layer metrics</h2><details><summary>{len(out)} figures (layer down, step "
            "across)</summary>" + "".join(out) + "</details>")


def _mesh(mesh) -> str:
    if not isinstance(mesh, dict):
        return fmt(mesh)
    axes = [f"{k} {v}" for k, v in mesh.items() if not k.startswith("dcn_") and v != 1]
    return " x ".join(axes) or "1 device"


def _gib(plan: dict, key: str) -> float | None:
    value = plan.get(key)
    return value / 2.0**30 if isinstance(value, int | float) else None


def plan_section(runs: list[Run]) -> str:
    """Each run's plan.json (maxmoe/plan/live.py): headline figures and bars."""
    out = []
    for run in runs:
        plan = run.plan
        if plan is None:
            continue
        rows = [["cluster", plan.get("cluster")], ["device kind", plan.get("device_kind")],
                ["mesh", _mesh(plan.get("mesh"))], ["devices", plan.get("devices")],
                ["peak memory per device (GiB)", _gib(plan, "peak_bytes_per_device")],
                ["usable per device (GiB)", _gib(plan, "usable_bytes_per_device")],
                ["fits", plan.get("fits")], ["step time (s, estimate)", plan.get("step_time_s")],
                ["tokens/s (estimate)", plan.get("tokens_per_second")],
                ["MFU (estimate)", plan.get("mfu")], ["cost (USD)", plan.get("cost_usd")],
                ["price", plan.get("price")], ["compile (s)", plan.get("compile_s")]]
        bars = figures.plan_svg(plan) or ""
        out.append(f"<h3>{esc(run.name)}</h3>"
                   + table(["figure", "value"], [r for r in rows if r[1] is not None]) + bars)
    if not out:
        return ""
    return ("<h2>Plan</h2><p class=muted>From &lt;run.dir&gt;/plan.json: the train step as "
            "compiled on the run's devices (<code>maxmoe train</code> writes it).</p>"
            + "".join(out))


def config_section(runs: list[Run]) -> str:
    """Each run's config.yaml, folded."""
    out = ["<h2>Config</h2>"]
    for run in runs:
        if run.config_text is None:
            out.append(f"<p>{esc(run.name)}: no config.yaml.</p>")
            continue
        out.append(f"<details><summary>{esc(run.name)}: config.yaml</summary>"
                   f"<pre>{esc(run.config_text)}</pre></details>")
    return "".join(out)


def goodput_section(runs: list[Run]) -> str:
    """Where each run's wall time went, over its restarts (train/goodput.py): seconds and share
    per bucket; goodput = productive / wall."""
    have = [r for r in runs if r.goodput]
    if not have:
        return ""
    names = [*BUCKETS, "idle", "down"]
    rows = [[esc(r.name), r.goodput["attempts"], f"{100 * r.goodput['goodput']:.1f}%",
             f"{r.goodput['wall_s']:.0f}",
             *(f"{r.goodput[f'{k}_s']:.0f} ({100 * r.goodput[f'{k}_s'] / r.goodput['wall_s']:.0f}%)"
               if r.goodput["wall_s"] > 0 else "n/a" for k in names)] for r in have]
    return ("<h2>Goodput</h2><p class=muted>Wall time over the run's restarts, seconds (share): "
            "down is the time between restarts, idle what no bucket timed.</p>"
            + table(["run", "attempts", "goodput", "wall s", *names], rows))


def render(runs: list[Run], notes: list[str]) -> str:
    """The whole page for `runs`, with `notes` (what was skipped) on top."""
    title = "maxmoe report: " + ", ".join(r.name for r in runs)
    loads = "".join(load_section(r) for r in runs)
    body = [f"<h1>{esc(title)}</h1>", notes_section(notes), summary_section(runs),
            goodput_section(runs), curves_section(runs), events_section(runs),
            "<h2>Expert load</h2><p class=muted>Per MoE layer: experts down, logged steps "
            "across (at most 400, evenly spaced), color = the expert's share of the layer's "
            "assignments over the uniform share. Red triangles: dead experts.</p>" + loads,
            layers_section(runs), plan_section(runs), config_section(runs)]
    return (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{esc(title)}"
            f"</title><style>{CSS}</style></head><body>{''.join(body)}</body></html>\n")


def write_report(paths: list[Path], out: Path | None = None) -> tuple[Path, list[str]]:
    """Renders the runs in `paths` into `out` (default <first run dir>/report.html); returns
    the file and the notes on what was skipped. Raises ConfigError on input it cannot use."""
    runs, notes = load_runs(paths)
    out = out if out is not None else paths[0] / "report.html"
    if out.is_dir():
        raise ConfigError(f"report: --out '{out}' is a directory; pass a file name such as "
                          f"'{out / 'report.html'}'")
    page = render(runs, notes)
    try:
        out.write_text(page, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"report: cannot write --out '{out}' ({e.strerror}); pass a writable "
                          "path") from None
    return out, notes
