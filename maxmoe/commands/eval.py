"""`maxmoe eval CKPT_OR_RUN_DIR [KEY=VALUE...] [--data SOURCE] [--batches N]`: held-out loss,
perplexity and tokens/s of a checkpoint, computed as the train loop's eval computes them."""

from __future__ import annotations

import argparse
import json
import sys

from maxmoe.commands.bench import positive_int
from maxmoe.commands.setup import configure
from maxmoe.config import ConfigError
from maxmoe.config_files import load_config

USAGE = """\
Evaluate a checkpoint: the mean next-token cross-entropy over the first train.eval_batches
batches of the validation split (the batches, and the compiled forward, of the train loop's
eval: at a step the run evaluated, the loss equals metrics.jsonl's eval_loss), its perplexity
and tokens/s. CKPT_OR_RUN_DIR is a run directory (its newest checkpoint) or one
<run.dir>/checkpoints/<step> folder; the model, mesh and data come from the run's config.yaml,
and KEY=VALUE overrides change them like `maxmoe train`'s do, e.g.

  maxmoe eval runs/tiny
  maxmoe eval runs/tiny/checkpoints/100 --batches 32
  maxmoe eval runs/tiny --data 'corpus/held_out/*.txt' mesh.data=1 mesh.fsdp=8

--data SOURCE evaluates another source (a glob of text files or a `maxmoe data prepare`
folder; the same as data.source=SOURCE data.mixture=''), always tokenized with the run's own
tokenizer. Only params are restored (no optimizer state), and nothing is written, so a run
that is still training can be evaluated as it goes."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="held-out loss and perplexity of a checkpoint",
                              description=USAGE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", metavar="CKPT_OR_RUN_DIR")
    p.add_argument("items", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--data", metavar="SOURCE", default="",
                   help="evaluate this data.source instead of the run's (its validation split)")
    p.add_argument("--batches", type=positive_int, default=0, metavar="N",
                   help="batches to evaluate (default: the run's train.eval_batches)")
    p.add_argument("--split", choices=("validation", "train"), default="validation",
                   help="which split of the source (default validation: held out in training)")
    p.set_defaults(run=run)


def overrides(args) -> list[str]:
    """The KEY=VALUE overrides of the command line, with --data and --batches as keys."""
    items = list(args.items)
    if args.data:
        items += [f"data.source={args.data}", "data.mixture="]
    if args.batches:
        items.append(f"train.eval_batches={args.batches}")
    return items


def run(args) -> int:
    """Prints the figures (process 0) and one JSON line; exit 0, or 2 with one line on a bad
    path, config or data source."""
    bad = [a for a in args.items if "=" not in a]
    if bad:
        raise ConfigError(f"argument {bad[0]!r}: maxmoe eval takes one CKPT_OR_RUN_DIR, then "
                          "KEY=VALUE overrides only; the config comes from the run directory")
    # late: JAX, Flax and the data pipeline; keeps `maxmoe --help` free of them (importing JAX
    # starts no backend: configure still sets the CPU device count first)
    import jax

    from maxmoe.train import evaluate as ev
    from maxmoe.train.setup import prepare_run

    run_dir, step_dir = ev.find_checkpoint(args.path)
    config_file = str(ev.run_config_file(run_dir, step_dir))
    cfg, sizes = configure([config_file, *overrides(args)], reads_data=True)
    run_cfg, _ = load_config([config_file])
    setup = prepare_run(cfg, sizes)
    result = ev.evaluate_checkpoint(setup, step_dir, ev.eval_tokenizer(run_cfg, cfg, run_dir),
                                   args.split)
    source = cfg.data.mixture or cfg.data.source
    if not result.batches:
        raise ConfigError(f"data {source!r}: its {args.split} split has no documents; pass "
                          "another --data, or raise data.validation_fraction")
    if jax.process_index() == 0:
        report = {"checkpoint": str(step_dir), "step": int(step_dir.name), "data": source,
                  "split": args.split, "eval_loss": result.loss,
                  "perplexity": result.perplexity, "batches": result.batches,
                  "tokens": result.tokens, "loss_tokens": result.loss_tokens,
                  "tokens_per_second": result.tokens_per_second,
                  "seconds": result.seconds, "compile_s": result.compile_seconds}
        print("\n".join([
            f"checkpoint  {step_dir} (step {step_dir.name})",
            f"data        {source} ({args.split}): {result.batches} batches of "
            f"{cfg.data.global_batch_size} x {cfg.data.seq_len} tokens",
            f"eval loss   {result.loss:.4f} nats/token (next-token cross-entropy over "
            f"{result.loss_tokens} target tokens)",
            f"perplexity  {result.perplexity:.2f}",
            f"tokens/s    {result.tokens_per_second:.0f} over {result.seconds:.1f} s "
            f"(compile {result.compile_seconds:.1f} s apart)"]), file=sys.stderr)
        print(json.dumps(report))
    return 0
