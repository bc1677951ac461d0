"""The `maxmoe` entry point: builds the parser from maxmoe/commands/, runs the verb, and turns
user errors into exit codes.

User mistakes (bad config, missing files) print one line and exit with code 2, before JAX
compiles anything; a stability guard's stop exits 3, Ctrl-C 130; a traceback means a bug in
maxmoe. Verbs may return other codes of their own (train: 75 when preempted).
"""

from __future__ import annotations

import argparse
import sys

from maxmoe import malloc
from maxmoe.commands import (
    bench,
    ckpt,
    convert,
    data,
    eval as evaluate,  # `eval` itself would shadow the builtin
    forward,
    generate,
    plan,
    report,
    train,
)
from maxmoe.config import ConfigError

# the order `maxmoe --help` lists them in
COMMANDS = (train, evaluate, generate, plan, data, bench, convert, ckpt, forward, report)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage mistakes are maxmoe's one line (a ConfigError naming the command
    and its --help), not argparse's usage block; the verbs' subparsers are of this class too."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message} (see '{self.prog} --help')")


def build_parser() -> argparse.ArgumentParser:
    """The `maxmoe` parser with every verb's subparser (imports no JAX)."""
    parser = _Parser(
        prog="maxmoe", description="Train Mixture-of-Experts language models with JAX.",
        epilog="Run 'maxmoe COMMAND --help' for the options of a command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs `maxmoe ARGV` (default: the process's arguments) and returns its exit code."""
    if argv is None:  # run as the `maxmoe` program, not embedded: pick the allocator first
        malloc.reexec(["-m", "maxmoe.cli", *sys.argv[1:]])
    parser = build_parser()
    try:
        # configs and KEY=VALUE overrides may come after options (`bench A.yaml --steps 5 k=v`)
        args, extra = parser.parse_known_args(argv)
        if extra:
            if not hasattr(args, "items") or any(a.startswith("-") for a in extra):
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            args.items += extra
        if args.command is None:
            parser.print_help()
            return 2
        return args.run(args)
    except ConfigError as e:
        print(f"maxmoe: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 a stability guard stopped training (train/guards.py)
        from maxmoe.train.guards import TrainingStopped  # late: guards imports JAX (--help speed)

        if not isinstance(e, TrainingStopped):
            raise
        print(f"maxmoe: stopped: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("maxmoe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
