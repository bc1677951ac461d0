"""`maxmoe report RUN_DIR... [--out FILE]`: a self-contained HTML page of one or more runs
(maxmoe/report/)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

USAGE = """\
Write one HTML page (no network, no scripts: open it in any browser, mail it, archive it) of
one or more run directories: loss and eval loss, learning rate, grad norm and loss scale,
tokens/s and MFU, with guard events (events.jsonl, skipped updates) marked on the curves; the
expert load of every MoE layer over time and the dead experts; every other logged scalar and
per-layer metric; the plan (plan.json) and config (config.yaml). Several runs overlay their
curves. Examples:

  maxmoe report runs/tiny                       # writes runs/tiny/report.html
  maxmoe report runs/a runs/b --out compare.html

Lines a killed run left cut off are skipped and named on the page and here."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("report", help="an HTML page of one or more runs",
                              description=USAGE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=Path)
    p.add_argument("--out", type=Path, default=None,
                   help="the HTML file (default: <first RUN_DIR>/report.html)")
    p.set_defaults(run=run)


def run(args) -> int:
    """Writes the page; prints what was skipped and where the page is. Exit 0, or 2 (via
    ConfigError) when no run can be shown."""
    # late: matplotlib takes a second to import; `maxmoe --help` stays free of it
    from maxmoe.report.page import write_report

    out, notes = write_report(args.run_dirs, args.out)
    for note in notes:
        print(f"maxmoe report: skipped: {note}", file=sys.stderr)
    print(f"maxmoe report: wrote {out}")
    return 0
