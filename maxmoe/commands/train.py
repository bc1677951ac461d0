"""`maxmoe train CONFIG... [KEY=VALUE...]`: train a model, resuming from its newest checkpoint."""

from __future__ import annotations

import argparse
import json
import time

from maxmoe.commands.setup import configure

USAGE = """\
Train a model. CONFIG files are YAML presets merged in order; KEY=VALUE overrides
(dotted keys, YAML values) are applied last, e.g.

  maxmoe train configs/tiny.yaml
  maxmoe train configs/tiny.yaml train.steps=500 run.dir=runs/longer mesh.expert=4

The resolved config is written to <run.dir>/config.yaml, metrics to <run.dir>/metrics.jsonl,
checkpoints to <run.dir>/checkpoints; running the same command again resumes from the newest
checkpoint."""

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: saved on SIGTERM before train.steps; run the command again


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a model from YAML configs", description=USAGE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="+", metavar="CONFIG_OR_KEY=VALUE")
    p.set_defaults(run=run)


def run(args) -> int:
    """Trains to train.steps; prints one JSON summary (process 0). Exit 0, or EXIT_PREEMPTED
    when SIGTERM stopped it after a save."""
    cfg, sizes = configure(args.items, reads_data=True)
    # late: JAX and the training loop; keeps `maxmoe --help` free of them
    import jax

    from maxmoe.train.loop import train

    t = time.perf_counter()
    summary = train(cfg, sizes)
    summary["wall_time_s"] = round(time.perf_counter() - t, 1)
    if jax.process_index() == 0:  # one summary per job, like the logs and metrics
        print(json.dumps(summary))
    # stopped early on SIGTERM after saving: a distinct code so schedulers restart the job
    return EXIT_PREEMPTED if summary.get("preempted") else 0
