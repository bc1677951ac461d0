"""`maxmoe data tokenizer|prepare`: the command line of the data preparation tools.

The tools themselves are maxmoe/data/ (tokenizer.py, prepare.py on datatrove). User mistakes raise
ConfigError, which maxmoe/cli.py prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from maxmoe.config import ConfigError
from maxmoe.data.corpus import unit_hash
from maxmoe.data.filters import FilterOptions
from maxmoe.data.sources import InputOptions, ReadErrors, list_inputs, read_documents

USAGE = """\
Prepare training data. Typical use:

  maxmoe data tokenizer 'corpus/**/*.jsonl.zst' --vocab-size 32000 --out data/tokenizer
  maxmoe data prepare 'corpus/**/*.jsonl.zst' --tokenizer data/tokenizer --out data/web
  maxmoe train configs/tiny.yaml data.source=data/web model.vocab_size=32000

INPUTS are directories, files or quoted globs of plain text, JSON lines or Parquet, optionally
gzip or zstd compressed."""

USAGE_PREPARE = """\
Clean, deduplicate and tokenize INPUTS into ArrayRecord shards under --out, with a held-out
validation split and a manifest.json of counts. Steps, in order: Unicode normalisation,
character-length filter, language filter, decontamination, exact dedup and MinHash near-dup
removal (both resolved across all tasks), then tokenize and token-length filter. Runs on datatrove's executors: --executor local (processes here), ray
(a Ray cluster) or slurm (job arrays). Bad files and lines are counted and skipped.
Re-running an interrupted run with the same arguments reruns only the unfinished tasks."""


def add_parser(subparsers) -> None:
    data = subparsers.add_parser("data", help="train a tokenizer, prepare datasets",
                                 description=USAGE,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    data.set_defaults(run=lambda args: (data.print_help(), 2)[1])
    commands = data.add_subparsers(dest="data_command", metavar="DATA_COMMAND")

    tokenizer = commands.add_parser(
        "tokenizer", help="train a SentencePiece tokenizer on a sample of INPUTS",
        description="Train a SentencePiece model (byte fallback, so any text round-trips) on "
                    "a sample of INPUTS and write OUT/tokenizer.model.")
    tokenizer.add_argument("inputs", nargs="+", metavar="INPUTS")
    tokenizer.add_argument("--vocab-size", type=int, required=True, help="pieces in the model")
    tokenizer.add_argument("--out", required=True, help="folder to write tokenizer.model into")
    tokenizer.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")
    tokenizer.add_argument("--sample-megabytes", type=float, default=100.0,
                           help="characters of text (millions) to train on (default 100)")
    _input_arguments(tokenizer)
    tokenizer.set_defaults(run=run_tokenizer)

    prepare = commands.add_parser("prepare", help="clean, dedup and tokenize INPUTS into shards",
                                  description=USAGE_PREPARE,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    prepare.add_argument("inputs", nargs="+", metavar="INPUTS")
    prepare.add_argument("--tokenizer", required=True, help="folder holding tokenizer.model (SentencePiece) or "
                         "tokenizer.json + tokenizer_config.json (Hugging Face)")
    prepare.add_argument("--out", required=True, help="output folder (new, or a run to resume)")
    _input_arguments(prepare)
    group = prepare.add_argument_group("filters")
    group.add_argument("--normalization", default="NFC",
                       help="Unicode normal form: NFC (default), NFKC, NFD, NFKD or none")
    for name in ("min-characters", "max-characters", "min-tokens", "max-tokens"):
        group.add_argument(f"--{name}", type=int, default=0, help="0 = no limit")
    group.add_argument("--languages", default="",
                       help="comma-separated ISO 639-1 codes to keep, e.g. en,de (default: all)")
    group.add_argument("--min-language-confidence", type=float, default=0.0,
                       help="also drop documents detected with a lower probability (0-1)")
    group = prepare.add_argument_group("deduplication and decontamination")
    group.add_argument("--no-exact-dedup", action="store_true", help="keep exact duplicates")
    group.add_argument("--no-near-dedup", action="store_true", help="keep near-duplicates")
    group.add_argument("--decontaminate", nargs="+", default=[], metavar="PATH",
                       help="evaluation files: drop documents sharing a 13-word n-gram with them")
    group = prepare.add_argument_group("output")
    group.add_argument("--validation-fraction", type=float, default=0.01)
    group.add_argument("--seed", type=int, default=0, help="seeds the validation choice")
    group.add_argument("--overwrite", action="store_true",
                       help="delete an earlier run in --out instead of resuming it")
    group = prepare.add_argument_group("execution (datatrove executors)")
    group.add_argument("--executor", default="local", choices=("local", "ray", "slurm"),
                       help="local processes (default), a Ray cluster, or Slurm job arrays")
    group.add_argument("--tasks", type=int, default=1,
                       help="tasks per stage = output shards; task k reads files k, k+N, ... "
                       "(the output depends on it, so a resumed run keeps it)")
    group.add_argument("--workers", type=int, default=0,
                       help="tasks run at once (local: 0 = one per core; ray: 0 = all)")
    group.add_argument("--ray-address", default="",
                       help="ray: a running cluster (HOST:PORT or auto); default: start one here")
    group.add_argument("--memory-gb-per-task", type=float, default=2.0,
                       help="ray and slurm: memory reserved for each task (default 2)")
    group.add_argument("--partition", default="", help="slurm: partition to submit to")
    group.add_argument("--time", default="24:00:00", help="slurm: time limit of each task")
    group.add_argument("--dry-run", action="store_true",
                       help="slurm: write the sbatch scripts and OUT/slurm/submit.sh, submit nothing")
    prepare.set_defaults(run=run_prepare)


def _input_arguments(parser) -> None:
    group = parser.add_argument_group("inputs")
    group.add_argument("--input-format", default="auto",
                       choices=("auto", "text", "jsonl", "parquet"),
                       help="auto: by file name (.jsonl/.json/.ndjson, .parquet, else text)")
    group.add_argument("--json-field", default="text", help="JSON lines field with the text")
    group.add_argument("--parquet-column", default="text", help="Parquet column with the text")
    group.add_argument("--text-document", default="file", choices=("file", "line"),
                       help="plain text: a document per file (default) or per line")


def _input_options(args) -> InputOptions:
    return InputOptions(input_format=args.input_format, json_field=args.json_field,
                        parquet_column=args.parquet_column, text_document=args.text_document)


def run_tokenizer(args) -> int:
    """Trains OUT/tokenizer.model on a sample of INPUTS; exit 0, or ConfigError."""
    # late: SentencePiece, needed by this command only; keeps `maxmoe --help` fast
    from maxmoe.data.tokenizer import MODEL_FILE, sentence_chunks, train_model

    if args.vocab_size < 16:
        raise ConfigError(f"option --vocab-size {args.vocab_size}: too small; use e.g. 32000")
    out = Path(args.out).expanduser()
    if (out / MODEL_FILE).exists():
        raise ConfigError(f"option --out {args.out!r}: already holds {MODEL_FILE}; choose "
                          "another folder or delete it")
    start = time.perf_counter()
    files = list_inputs(args.inputs)
    # Files in hash order, so the sample mixes all folders instead of the first ones.
    files.sort(key=lambda f: unit_hash(os.path.basename(f), 0))
    options, errors = _input_options(args), ReadErrors()
    budget = args.sample_megabytes * 1e6
    sentences, characters = [], 0
    for path in files:
        for text in read_documents(path, options, errors):
            sentences.extend(sentence_chunks(text))
            characters += len(text)
            if characters >= budget:
                break
        if characters >= budget:
            break
    if not sentences:
        raise ConfigError(f"inputs {' '.join(args.inputs)!r}: no readable text in {len(files)} "
                          "files; check --input-format, --json-field or --parquet-column")
    model = train_model(sentences, args.vocab_size, model_type=args.model_type,
                        problem_key=f"option --vocab-size {args.vocab_size}",
                        sample=f"{characters / 1e6:.2f} M characters")
    out.mkdir(parents=True, exist_ok=True)
    temporary = out / (MODEL_FILE + ".tmp")
    temporary.write_bytes(model)
    os.replace(temporary, out / MODEL_FILE)
    (out / "tokenizer.json").write_text(json.dumps({
        "inputs": args.inputs, "vocab_size": args.vocab_size, "model_type": args.model_type,
        "sample_characters": characters, "read_errors": dict(errors.counts)}, indent=1))
    _report_errors(errors.counts, errors.examples)
    print(f"maxmoe: trained a {args.vocab_size}-piece {args.model_type} tokenizer on "
          f"{characters / 1e6:.1f} M characters in {time.perf_counter() - start:.1f} s -> "
          f"{out / MODEL_FILE}")
    return 0


def run_prepare(args) -> int:
    """Writes the shards and manifest of INPUTS under --out; exit 0, or ConfigError."""
    # late: datatrove, NumPy, SentencePiece, needed by this command only; keeps `--help` fast
    from maxmoe.data.executors import LaunchOptions
    from maxmoe.data.prepare import PrepareOptions, prepare

    languages = tuple(code.strip() for code in args.languages.split(",") if code.strip())
    options = PrepareOptions(
        inputs=_input_options(args),
        filters=FilterOptions(
            normalization=args.normalization, min_characters=args.min_characters,
            max_characters=args.max_characters, min_tokens=args.min_tokens,
            max_tokens=args.max_tokens, languages=languages,
            min_language_confidence=args.min_language_confidence),
        exact_dedup=not args.no_exact_dedup, near_dedup=not args.no_near_dedup,
        decontaminate=tuple(args.decontaminate),
        validation_fraction=args.validation_fraction, seed=args.seed, tasks=args.tasks,
        launch=LaunchOptions(executor=args.executor, workers=args.workers,
                             ray_address=args.ray_address,
                             memory_gb_per_task=args.memory_gb_per_task,
                             partition=args.partition, time=args.time, dry_run=args.dry_run))
    start = time.perf_counter()
    manifest = prepare(args.inputs, args.tokenizer, args.out, options, overwrite=args.overwrite)
    if manifest is None:
        done = ("wrote the sbatch scripts of every stage and their submission script "
                f"{Path(args.out) / 'slurm' / 'submit.sh'}" if args.dry_run else
                f"submitted every stage to Slurm; {Path(args.out) / 'manifest.json'} appears "
                "when the last job ends")
        print(f"maxmoe: {done}")
        return 0
    seconds = time.perf_counter() - start
    written, tokens = manifest["documents_written"], manifest["tokens_written"]
    print(f"maxmoe: {manifest['documents_read']} documents read from "
          f"{manifest['input_files']} files in {seconds:.1f} s; kept {written['train']} train + "
          f"{written['validation']} validation ({tokens['train']} + {tokens['validation']} "
          f"tokens) in {len(manifest['shards'])} shards -> {args.out}")
    if manifest["dropped"]:
        print("maxmoe: dropped " + ", ".join(f"{n} {reason.replace('_', ' ')}"
                                             for reason, n in manifest["dropped"].items()))
    _report_errors(manifest["read_errors"], manifest["read_error_examples"])
    if not written["train"]:
        raise ConfigError(f"inputs {' '.join(args.inputs)!r}: no document survived reading and "
                          "filtering (counts above); check the input options or loosen filters")
    return 0


def _report_errors(counts: dict, examples: list[str]) -> None:
    if not counts:
        return
    print("maxmoe: skipped " + ", ".join(f"{n} {kind.replace('_', ' ')}"
                                         for kind, n in sorted(counts.items()))
          + " (first: " + "; ".join(examples[:3]) + ")", file=sys.stderr)
