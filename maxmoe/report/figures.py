"""The report's figures, drawn with matplotlib (its object API: no pyplot, no global figure
state) and returned as inline SVG text (curves, bars) or base64 PNG data URIs (heatmaps).

Curves hold at most MAX_POINTS points per run: each bucket of steps keeps its lowest and
highest value, so a 100k-step run stays small and a one-step spike still shows. Guard events
and skipped updates are markers along the top edge of every curve panel.
"""

from __future__ import annotations

import base64
import io

import matplotlib as mpl
import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.transforms import blended_transform_factory

from maxmoe.report.runs import Run, Series

MAX_POINTS = 2000  # points per curve per run (min-max decimation)
LOAD_VMAX = 3.0  # heatmap color range of the load relative to uniform (fraction x E): 0..3
# guard events (events.jsonl kinds, plus skipped updates read from the metrics): marker shapes
EVENT_MARKERS = {"skip": "x", "rollback": "<", "stop": "s", "spike": "^", "router": "d",
                 "dead_experts": "o", "warning": "."}
RC = {"svg.fonttype": "none", "font.size": 8, "axes.titlesize": 9, "axes.grid": True,
      "grid.alpha": 0.3, "svg.hashsalt": None}


def run_color(i: int) -> str:
    """The color of the i-th run, the same in every figure."""
    return f"C{i % 10}"


def run_hex(i: int) -> str:
    """run_color as #rrggbb, for HTML."""
    return mpl.colors.to_hex(run_color(i))


def svg_text(fig: Figure) -> str:
    """The figure as an <svg> element to inline in HTML (the XML prologue dropped)."""
    buf = io.StringIO()
    with mpl.rc_context(RC):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    start, end = text.find("<metadata>"), text.find("</metadata>")  # RDF links to the web
    return text[:start] + text[end + len("</metadata>"):] if 0 <= start < end else text


def png_uri(fig: Figure, dpi: int = 90, tight: bool = True) -> str:
    """The figure as a data:image/png;base64 URI (`tight`: cropped to what is drawn)."""
    buf = io.BytesIO()
    with mpl.rc_context(RC):
        fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight" if tight else None,
                    metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def new_figure(width: float, height: float) -> Figure:
    """A figure drawn under the report's rc settings."""
    with mpl.rc_context(RC):
        return Figure(figsize=(width, height), layout="constrained")


def downsample(steps: np.ndarray, values: np.ndarray, max_points: int = MAX_POINTS):
    """(steps, values) cut to at most about `max_points`: per bucket of consecutive points, the
    lowest and the highest (NaNs, which mark skipped steps, kept as they are where a bucket
    has nothing else)."""
    n = len(steps)
    if n <= max_points:
        return steps, values
    buckets = np.array_split(np.arange(n), max_points // 2)
    keep = []
    for b in buckets:
        v = values[b]
        finite = np.isfinite(v)
        if not finite.any():
            keep.append(b[0])
            continue
        idx = b[finite]
        keep += sorted({idx[np.argmin(v[finite])], idx[np.argmax(v[finite])]})
    keep = np.asarray(keep)
    return steps[keep], values[keep]


def event_steps(run: Run) -> dict[str, np.ndarray]:
    """Kind -> steps of the run's guard events; steps whose metrics show skipped updates
    (`skipped`, or `skipped_steps` grown since the last logged step) count as "skip"."""
    kinds: dict[str, set[int]] = {}
    for e in run.events:
        kinds.setdefault(e["kind"], set()).add(e["step"])
    skips = set()
    if "skipped_steps" in run.scalars:
        s = run.scalars["skipped_steps"]
        grown = np.diff(np.concatenate([[0.0], np.nan_to_num(s.values)])) > 0
        skips |= set(s.steps[grown].tolist())
    if "skipped" in run.scalars:
        s = run.scalars["skipped"]
        skips |= set(s.steps[np.nan_to_num(s.values) > 0].tolist())
    if skips:
        kinds.setdefault("skip", set()).update(skips)
    return {k: np.asarray(sorted(v)) for k, v in kinds.items()}


def _mark_events(ax, runs: list[Run], events: list[dict[str, np.ndarray]]) -> None:
    top = blended_transform_factory(ax.transData, ax.transAxes)
    for i, kinds in enumerate(events):
        for kind, steps in kinds.items():
            y = np.full(len(steps), 0.97 - 0.05 * i)
            ax.plot(steps, y, linestyle="none", marker=EVENT_MARKERS.get(kind, "*"),
                    color=run_color(i), markersize=5, transform=top, clip_on=False)


def _plot_key(ax, run_index: int, run: Run, key: str, dashed: bool) -> bool:
    if key not in run.scalars:
        return False
    s = run.scalars[key]
    steps, values = downsample(s.steps, s.values)
    if not np.isfinite(values).any():
        return False
    style = dict(linestyle="--", marker="o", markersize=3) if dashed else dict(linewidth=1)
    ax.plot(steps, values, color=run_color(run_index), **style)
    return True


def curves_svg(runs: list[Run], panels: list[tuple[str, list[str], bool]],
               columns: int = 3, panel_width: float = 4.3) -> str:
    """One figure of curve panels (title, [keys: first solid, others dashed], log y), every run
    overlaid in its color, guard events marked on top; SVG text. A key no run logged shows
    "not logged"."""
    rows = -(-len(panels) // columns)
    fig = new_figure(panel_width * min(columns, len(panels)), 3.0 * rows + 0.4)
    axes = fig.subplots(rows, min(columns, len(panels)), squeeze=False).ravel()
    events = [event_steps(r) for r in runs]
    for ax, (title, keys, log) in zip(axes, panels, strict=False):
        drawn = [_plot_key(ax, i, run, key, dashed=j > 0)
                 for i, run in enumerate(runs) for j, key in enumerate(keys)]
        ax.set_title(title)
        ax.set_xlabel("step")
        if not any(drawn):
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        if log:
            ax.set_yscale("log")
        _mark_events(ax, runs, events)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    handles = [Line2D([], [], color=run_color(i), label=r.name) for i, r in enumerate(runs)]
    kinds = sorted({k for e in events for k in e})
    handles += [Line2D([], [], color="black", linestyle="none",
                       marker=EVENT_MARKERS.get(k, "*"), label=f"event: {k}") for k in kinds]
    fig.legend(handles=handles, loc="outside upper center", ncols=min(len(handles), 6),
               frameon=False)
    return svg_text(fig)


def _span(first: float, last: float) -> tuple[float, float]:
    """An image's x extent over steps first..last (one logged step gets a unit width)."""
    return (first - 0.5, last + 0.5) if first == last else (first, last)


def matrix_uri(matrix: np.ndarray, title: str, xlabel: str, ylabel: str,
               x_range: tuple[float, float] | None = None, cmap: str = "viridis",
               vmin: float | None = None, vmax: float | None = None) -> str:
    """A [rows, columns] matrix as an image with a colorbar (rows down; columns across, spread
    over x_range when given: steps); PNG data URI."""
    rows, cols = matrix.shape
    x0, x1 = _span(*x_range) if x_range is not None else (-0.5, cols - 0.5)
    fig = new_figure(9.0, 1.2 + min(0.09 * rows, 7.0))
    ax = fig.subplots()
    im = ax.imshow(matrix, aspect="auto", interpolation="nearest", extent=(x0, x1, rows - 0.5,
                   -0.5), cmap=cmap, vmin=vmin, vmax=vmax)
    ax.grid(False)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.colorbar(im, ax=ax, pad=0.01)
    return png_uri(fig)


def layer_time_uri(series: Series, title: str, ylabel: str, **kwargs) -> str:
    """A [T, L] series as an image: steps across, layers down, value in color; PNG data URI."""
    values = series.values.reshape(len(series.steps), -1).T  # [L, T]
    return matrix_uri(values, title, "step", ylabel,
                      x_range=(float(series.steps[0]), float(series.steps[-1])), **kwargs)


def load_panel_uri(steps: np.ndarray, load: np.ndarray, title: str, dead: list[int]) -> str:
    """One MoE layer's expert load over time: load [T, E] fractions, drawn as fraction x E
    (1 = uniform) with experts down and steps across; dead experts marked by red triangles at
    the right edge. PNG data URI."""
    experts = load.shape[1]
    with mpl.rc_context(RC):  # a fixed layout: a 671B run draws 59 of these
        fig = Figure(figsize=(3.6, 2.5))
        ax = fig.add_axes((0.17, 0.19, 0.76, 0.7))
    extent = (*_span(float(steps[0]), float(steps[-1])), experts - 0.5, -0.5)
    ax.imshow(load.T * experts, aspect="auto", interpolation="antialiased", extent=extent,
              cmap="viridis", vmin=0.0, vmax=LOAD_VMAX)
    ax.grid(False)
    if dead:
        right = blended_transform_factory(ax.transAxes, ax.transData)
        ax.plot(np.full(len(dead), 1.02), dead, linestyle="none", marker="<", color="red",
                markersize=4, transform=right, clip_on=False)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("expert")
    return png_uri(fig, tight=False)


def load_colorbar_uri() -> str:
    """The shared color scale of the load panels, as a PNG data URI."""
    fig = new_figure(4.5, 0.6)
    ax = fig.subplots()
    norm = mpl.colors.Normalize(0.0, LOAD_VMAX)
    fig.colorbar(mpl.cm.ScalarMappable(norm=norm, cmap="viridis"), cax=ax,
                 orientation="horizontal",
                 label=f"expert load / uniform share (fraction x E; 0 = no tokens, clipped at "
                       f"{LOAD_VMAX:g})")
    return png_uri(fig)


def _bars(ax, title: str, named: dict[str, float], unit: str) -> None:
    names = list(named)
    ax.barh(names, [named[n] for n in names], color="C0")
    ax.invert_yaxis()
    ax.set_title(title)
    ax.set_xlabel(unit)


def plan_svg(plan: dict) -> str | None:
    """Bars of plan.json's memory by part (GiB, with the usable memory), the step time's parts
    (s) and the collective bytes per step by mesh axis (MiB, ICI and DCN); None when the plan
    has none of them."""
    gib, mib = 2.0**30, 2.0**20
    panels = []
    memory = {k: v / gib for k, v in (plan.get("memory_by_part") or {}).items()
              if isinstance(v, int | float)}
    peak, usable = plan.get("peak_bytes_per_device"), plan.get("usable_bytes_per_device")
    if memory and isinstance(peak, int | float):
        memory = {"peak (all parts, overlapping)": peak / gib, **memory}
    if memory:
        panels.append(("memory per device by part", memory, "GiB"))
    parts = {k: v for k, v in (plan.get("step_time_parts_s") or {}).items()
             if isinstance(v, int | float)}
    if parts:
        panels.append(("step time parts (estimate)", parts, "s"))
    comm = {}
    for axis, kinds in (plan.get("collective_bytes_per_step") or {}).items():
        if isinstance(kinds, dict):
            for link in ("ici", "dcn"):
                total = sum(v for k in kinds.values() if isinstance(k, dict)
                            for v in [k.get(link)] if isinstance(v, int | float))
                if total:
                    comm[f"{axis} ({link})"] = total / mib
    if comm:
        panels.append(("collective bytes per step by mesh axis", comm, "MiB"))
    if not panels:
        return None
    fig = new_figure(4.3 * len(panels), 0.9 + 0.25 * max(len(p[1]) for p in panels))
    for ax, (title, named, unit) in zip(fig.subplots(1, len(panels), squeeze=False).ravel(),
                                        panels, strict=True):
        _bars(ax, title, named, unit)
        # the usable line only where it does not squash the bars (the table says it anyway)
        if (unit == "GiB" and isinstance(usable, int | float)
                and usable / gib < 10 * max(named.values())):
            ax.axvline(usable / gib, color="red", linestyle="--")
            ax.text(usable / gib, 0, " usable", color="red", va="top")
    return svg_text(fig)
