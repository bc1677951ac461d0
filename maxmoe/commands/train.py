"""`maxmoe train CONFIG... [KEY=VALUE...]`: train a model, resuming from its newest checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
import time

from maxmoe.commands.setup import configure

USAGE = """\
Train a model. CONFIG files are YAML presets merged in order; KEY=VALUE overrides
(dotted keys, YAML values) are applied last, e.g.

  maxmoe train configs/tiny.yaml
  maxmoe train configs/tiny.yaml train.steps=500 run.dir=runs/longer mesh.expert=4

The resolved config is written to <run.dir>/config.yaml, metrics to <run.dir>/metrics.jsonl,
checkpoints to <run.dir>/checkpoints, the plan's figures of the compiled step (memory, traffic,
roofline step time, cost; see `maxmoe plan`) to <run.dir>/plan.json; running the same command
again resumes from the newest checkpoint.

--dry-run runs as the whole job (every process and device) but stops after validating and
compiling the first step from abstract arrays: it prints the memory per device and the plan's
figures, reads no data, writes nothing (run.dir untouched) and exits 0 when the step fits the
devices' memory, 1 when it does not. Run it before committing a cluster's hours."""

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: saved on SIGTERM before train.steps; run the command again


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a model from YAML configs", description=USAGE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="+", metavar="CONFIG_OR_KEY=VALUE")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and compile on the real devices, print memory and the plan, "
                        "write nothing; exit 0 if it fits, 1 if not")
    p.add_argument("--cluster", default="", metavar="CLUSTER",
                   help="price the plan with this configs/cluster/ file or COUNTxKIND's device "
                        "figures (default: the kind of the devices present)")
    p.set_defaults(run=run)


def run(args) -> int:
    """Trains to train.steps; prints one JSON summary (process 0). Exit 0, or EXIT_PREEMPTED
    when SIGTERM stopped it after a save. --dry-run: exit 0 when the step fits, 1 when not."""
    # the dry run validates the data keys too (no data is read): the real run will need them
    cfg, sizes = configure(args.items, reads_data=True)
    # late: JAX, the training loop and the planner; keeps `maxmoe --help` free of them
    import jax
    import psutil

    from maxmoe.plan.live import dry_run, live_cluster, plan_writer
    from maxmoe.train.init_from import needs_init_from, open_init_source
    from maxmoe.train.loop import train

    if args.dry_run:
        if needs_init_from(cfg):  # a checkpoint the real run cannot start from fails here too
            open_init_source(cfg)
        return dry_run(cfg, sizes, args.cluster, sys.stdout)
    # the planner prices <run.dir>/plan.json; a bad --cluster fails before the run dir is made
    write_plan = plan_writer(live_cluster(args.cluster))
    t = time.perf_counter()
    # goodput's startup counts from the process's start: imports and the distributed join too
    summary = train(cfg, sizes, first_compiled=write_plan,
                    started=psutil.Process().create_time())
    summary["wall_time_s"] = round(time.perf_counter() - t, 1)
    if jax.process_index() == 0:  # one summary per job, like the logs and metrics
        print(json.dumps(summary))
    # stopped early on SIGTERM after saving: a distinct code so schedulers restart the job
    return EXIT_PREEMPTED if summary.get("preempted") else 0
