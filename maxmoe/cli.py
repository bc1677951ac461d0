"""`maxmoe` command line: train (more subcommands plug in here).

User mistakes (bad config, missing files) print one line and exit with code 2, before JAX
compiles anything; a traceback means a bug in maxmoe.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

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


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def reexec_with_huge_pages() -> None:
    """Restarts this process (same pid, arguments and environment) with glibc's malloc asking
    for transparent huge pages, where the kernel grants them only on request ("madvise").

    XLA:CPU maps every step's temporaries afresh (355 MB at the reference shape of issue 8),
    and touching them page by page cost 4 KiB page faults throughout the step: 2 MiB pages
    made that step 1.12x faster (409 -> 365 ms). GLIBC_TUNABLES is read only at process start,
    hence the exec. MAXMOE_HUGE_PAGES=0 opts out; other libcs ignore the tunable."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if (sys.platform != "linux" or os.environ.get("MAXMOE_HUGE_PAGES", "1") == "0"
            or "glibc.malloc.hugetlb" in tunables):
        return
    try:
        with open(THP_MODE) as f:
            if "[madvise]" not in f.read():  # [always]: already on; [never]: not available
                return
    except OSError:
        return
    env = dict(os.environ, GLIBC_TUNABLES=f"{tunables}:{HUGE_PAGES_TUNABLE}".lstrip(":"))
    os.execve(sys.executable, [sys.executable, "-m", "maxmoe.cli", *sys.argv[1:]], env)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # run as the `maxmoe` program, not embedded
        reexec_with_huge_pages()
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
