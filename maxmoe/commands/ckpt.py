"""`maxmoe ckpt verify RUN_DIR|STEP_DIR`: reads back every chunk of every committed checkpoint
and compares it with the crc32c recorded when it was saved (maxmoe/train/checksums.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from maxmoe.config import ConfigError

USAGE = """\
Check saved checkpoints against the checksums written with them: every chunk of every array of
every committed step is read back from disk and its crc32c compared, so a flipped bit in a data
file is found before a restore would load it silently. PATH is a run directory (all its
committed steps), its checkpoints/ folder, one checkpoints/<step> folder, or a converted
checkpoint (`maxmoe convert from-hf`'s OUT_DIR). Read-only: safe while a job is saving.

  maxmoe ckpt verify runs/tiny
  maxmoe ckpt verify runs/tiny/checkpoints/150

Exit 0: every checked step is intact (steps saved without checksums are named, not failed); 1: the bad arrays and chunks are listed; 2: PATH holds no checkpoint."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("ckpt", help="check saved checkpoints (checksums)",
                              description="Checkpoint tools: 'maxmoe ckpt verify PATH'.")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    v = sub.add_parser("verify", help="compare every saved chunk with its recorded crc32c",
                       description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    v.add_argument("path", metavar="RUN_DIR|STEP_DIR", type=Path)
    p.set_defaults(run=run)


def run(args) -> int:
    """One line per checkpoint on stdout (and one per bad chunk); exit 0, 1 or 2 (USAGE)."""
    # late: TensorStore and Orbax; keeps `maxmoe --help` free of them
    from maxmoe.train.checksums import items_under, verify_item

    items = items_under(args.path)
    if not items:
        raise ConfigError(f"{args.path}: no checkpoint here; pass a run directory, a "
                          "checkpoints/<step> folder or a converted checkpoint directory")
    failed = 0
    for item, sums in items:
        report = verify_item(item, sums)
        name = item.parent if item.name == "state" else item
        if report.bad is None:
            print(f"{name}: saved without checksums (before maxmoe wrote them, or with "
                  "checkpoint.checksums=false): not checked")
        elif report.bad:
            failed += 1
            print(f"{name}: BAD, {len(report.bad)} of {report.chunks} chunks")
            for mismatch in report.bad:
                print(f"  {mismatch.line()}")
        else:
            print(f"{name}: ok, {report.arrays} arrays, {report.chunks} chunks, "
                  f"{report.nbytes / 2**20:.1f} MiB read back")
    if failed:
        print(f"maxmoe ckpt verify: {failed} of {len(items)} checkpoints have bad arrays",
              file=sys.stderr)
    return 1 if failed else 0
