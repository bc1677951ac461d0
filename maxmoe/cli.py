"""`maxmoe` command line: train (more subcommands plug in here).

User mistakes (bad config, missing files) print one line and exit with code 2, before JAX
compiles anything; a traceback means a bug in maxmoe.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

from maxmoe import malloc
from maxmoe.config import ConfigError, load_config

# modules with add_parser(subparsers) -> registers a subcommand whose default `run(args)`
# returns an exit code; keep their imports of JAX inside `run` so --help stays fast
SUBCOMMAND_MODULES: list[str] = ["maxmoe.data.cli", "maxmoe.bench", "maxmoe.convert.command",
                                 "maxmoe.convert.forward"]

USAGE_TRAIN = """\
Train a model. CONFIG files are YAML presets merged in order; KEY=VALUE overrides
(dotted keys, YAML values) are applied last, e.g.

  maxmoe train configs/tiny.yaml
  maxmoe train configs/tiny.yaml train.steps=500 run.dir=runs/longer mesh.expert=4

The resolved config is written to <run.dir>/config.yaml, metrics to <run.dir>/metrics.jsonl,
checkpoints to <run.dir>/checkpoints; running the same command again resumes from the newest
checkpoint."""


EXIT_PREEMPTED = 75  # EX_TEMPFAIL: saved on SIGTERM before train.steps; run the command again


def _split_args(items: list[str]) -> tuple[list[str], list[str]]:
    files = [a for a in items if "=" not in a]
    overrides = [a for a in items if "=" in a]
    return files, overrides


def prepare(items: list[str]):
    """Loads and validates the config, then sets up devices (before any compilation)."""
    files, overrides = _split_args(items)
    cfg, origins = load_config(files, overrides)
    import jax  # imported late: the fake CPU device count must be set before backends start

    if cfg.mesh.cpu_devices:
        try:
            jax.config.update("jax_num_cpu_devices", cfg.mesh.cpu_devices)
        except RuntimeError:  # backend already started (e.g. embedded use): keep its devices
            pass
    from maxmoe.distributed import initialize

    initialize(cfg.distributed)
    from maxmoe.validation import validate

    sizes = validate(cfg, jax.device_count(), origins, jax.process_count())
    return cfg, sizes


def cmd_train(args) -> int:
    cfg, sizes = prepare(args.items)
    from maxmoe.train.loop import train

    t = time.perf_counter()
    summary = train(cfg, sizes)
    summary["wall_time_s"] = round(time.perf_counter() - t, 1)
    import jax

    if jax.process_index() == 0:  # one summary per job, like the logs and metrics
        print(json.dumps(summary))
    # stopped early on SIGTERM after saving: a distinct code so schedulers restart the job
    return EXIT_PREEMPTED if summary.get("preempted") else 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as the `maxmoe` program, not embedded: pick the allocator first
        malloc.reexec(["-m", "maxmoe.cli", *sys.argv[1:]])
    parser = argparse.ArgumentParser(
        prog="maxmoe", description="Train Mixture-of-Experts language models with JAX.",
        epilog="Run 'maxmoe COMMAND --help' for the options of a command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("train", help="train a model from YAML configs",
                       description=USAGE_TRAIN, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="+", metavar="CONFIG_OR_KEY=VALUE")
    p.set_defaults(run=cmd_train)
    # other subcommands live with their concern; each module adds its own parser
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).add_parser(sub)
    # configs and KEY=VALUE overrides may come after options too (`bench A.yaml --steps 5 k=v`)
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "items") or any(a.startswith("-") for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.items += extra
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except ConfigError as e:
        print(f"maxmoe: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 a stability guard stopped training (train/guards.py)
        from maxmoe.train.guards import TrainingStopped  # late: keeps --help free of JAX

        if not isinstance(e, TrainingStopped):
            raise
        print(f"maxmoe: stopped: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("maxmoe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
