"""`maxmoe data prepare`: raw documents -> cleaned, deduplicated, tokenized ArrayRecord shards.

    main process: list inputs -> read documents in file order -> batches of documents
    worker processes: normalise -> character / language filters -> tokenize -> token filter
                      -> content hash + MinHash signature
    main process, in input order: exact dedup -> near dedup (LSH) -> train/validation split
                      -> shard files + done marker -> manifest

Shards are cut from the input stream by characters read, so shard k always holds the same
documents for the same inputs and settings. A re-run reads past finished shards without
processing them and reloads their dedup state, so it produces exactly what one run would.
Only the order-dependent steps (dedup decisions, writing) stay in the main process; the
expensive per-document work is spread over all cores.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from maxmoe.config import ConfigError
from maxmoe.data import shards
from maxmoe.data.corpus import unit_hash
from maxmoe.data.dedup import DedupOptions, NearDuplicateIndex, signature
from maxmoe.data.filters import (
    FilterOptions,
    character_filter,
    content_hash,
    language_filter,
    normalize,
    token_filter,
)
from maxmoe.data.sources import InputOptions, ReadErrors, list_inputs, read_documents
from maxmoe.data.tokenizer import Tokenizer, open_tokenizer


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
    inputs: InputOptions = InputOptions()
    filters: FilterOptions = FilterOptions()
    dedup: DedupOptions = DedupOptions()
    validation_fraction: float = 0.01  # share of documents held out, chosen by content hash
    seed: int = 0  # seeds the validation choice
    shard_megabytes: float = 64.0  # raw text (millions of characters) per shard
    workers: int = 0  # worker processes; 0 = all cores, 1 = everything in this process
    batch_documents: int = 128  # documents per work item sent to a worker
    progress: bool = True  # tqdm bars on stderr

    def check(self) -> None:
        self.filters.check()
        self.dedup.check()
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ConfigError(f"option --validation-fraction {self.validation_fraction}: must "
                              "be in [0, 1); use e.g. 0.01")
        if self.shard_megabytes <= 0:
            raise ConfigError(f"option --shard-megabytes {self.shard_megabytes}: must be > 0; "
                              "use e.g. 64")
        if self.workers < 0:
            raise ConfigError(f"option --workers {self.workers}: must be >= 0; 0 uses all cores")

    def worker_count(self) -> int:
        return self.workers or max(1, len(os.sched_getaffinity(0)))


# --------------------------------------------------------------------------- worker side

_WORKER: tuple[PrepareOptions, Tokenizer, np.dtype] | None = None


def _start_worker(options: PrepareOptions, tokenizer_path: str) -> None:
    global _WORKER
    tokenizer = open_tokenizer(tokenizer_path)
    _WORKER = (options, tokenizer, shards.token_dtype(tokenizer.vocab_size))


def _clean(texts: list[str]) -> list[tuple]:
    """Per document: (drop reason, None, None, None, 0) or (None, hash, signature, ids, count)."""
    options, tokenizer, dtype = _WORKER
    results = []
    for text in texts:
        try:
            results.append(_clean_one(text, options, tokenizer, dtype))
        except Exception:  # noqa: BLE001 -- one pathological document must not end the job
            results.append(("unprocessable", None, None, None, 0))
    return results


def _clean_one(text: str, options: PrepareOptions, tokenizer: Tokenizer,
               dtype: np.dtype) -> tuple:
    text = normalize(text, options.filters)
    reason = character_filter(text, options.filters) or language_filter(text, options.filters)
    if reason:
        return reason, None, None, None, 0
    ids = tokenizer.encode(text)
    reason = token_filter(len(ids), options.filters)
    if reason:
        return reason, None, None, None, 0
    minhash = signature(text, options.dedup) if options.dedup.near else None
    return None, content_hash(text), minhash, np.asarray(ids, dtype).tobytes(), len(ids)


# --------------------------------------------------------------------------- main side


@dataclasses.dataclass
class _Batch:
    shard: int
    texts: list[str]
    last: bool  # the shard ends with this batch
    errors: ReadErrors  # read problems met while reading this batch
    skip: bool = False  # the shard was finished by an earlier run


@dataclasses.dataclass
class _ShardState:
    records: dict = dataclasses.field(default_factory=lambda: {s: [] for s in shards.SPLITS})
    tokens: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    errors: ReadErrors = dataclasses.field(default_factory=ReadErrors)
    hashes: list = dataclasses.field(default_factory=list)
    signatures: list = dataclasses.field(default_factory=list)
    documents_read: int = 0


def prepare(inputs: list[str], tokenizer_dir: str, out: str,
            options: PrepareOptions = PrepareOptions(), overwrite: bool = False) -> dict:
    """Runs the whole preparation into `out` (resuming a previous run); returns the manifest."""
    options.check()
    files = list_inputs(inputs)
    # a SentencePiece model (`maxmoe data tokenizer` trains one) or a Hugging Face folder
    tokenizer = open_tokenizer(tokenizer_dir, f"option --tokenizer {tokenizer_dir!r}")
    tokenizer_path = tokenizer.path
    tokenizer_hash = tokenizer.sha256
    directory = Path(out).expanduser().resolve()
    settings = {
        "options": _settings_of(options),
        "tokenizer_sha256": tokenizer_hash,
        # Shard boundaries depend on the exact input list, so a changed list cannot resume.
        "files": [[f, os.path.getsize(f)] for f in files],
    }
    _claim_directory(directory, settings, overwrite)
    tokenizer.save(directory / shards.TOKENIZER_DIR)

    exact: set[bytes] = set()
    near = NearDuplicateIndex(options.dedup) if options.dedup.near else None
    bars = _Bars(sum(os.path.getsize(f) for f in files), options.progress)
    markers: list[dict] = []
    workers = options.worker_count()
    pool = None
    if workers > 1:
        # spawn, not fork: the caller may hold JAX or grain threads that fork would copy.
        # An executor, not multiprocessing.Pool: a killed worker (OOM) raises here instead
        # of hanging the job forever; the re-run then resumes at the unfinished shard.
        pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker, initargs=(options, str(tokenizer_path)))
    else:
        _start_worker(options, str(tokenizer_path))
    try:
        state = _ShardState()
        pending: collections.deque = collections.deque()
        for batch in _batches(files, options, directory, bars):
            work = None if batch.skip else (
                pool.submit(_clean, batch.texts) if pool else _clean(batch.texts))
            pending.append((batch, work))
            # bounded look-ahead: workers stay busy while memory holds a few batches only
            while len(pending) > 2 * workers + 2 or (pending and not pool):
                state = _finish(pending.popleft(), state, directory, exact, near, options,
                                tokenizer_hash, markers, bars)
        while pending:
            state = _finish(pending.popleft(), state, directory, exact, near, options,
                            tokenizer_hash, markers, bars)
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        bars.close()
    manifest = _manifest(inputs, settings, tokenizer, tokenizer_hash, markers)
    shards.write_json(directory / shards.MANIFEST, manifest)
    return manifest


def _settings_of(options: PrepareOptions) -> dict:
    settings = dataclasses.asdict(options)
    for key in ("workers", "batch_documents", "progress"):  # do not change the output
        settings.pop(key)
    return settings


def _claim_directory(directory: Path, settings: dict, overwrite: bool) -> None:
    """Checks that `directory` is new, or holds a run with identical settings (to resume)."""
    path = directory / shards.SETTINGS
    if directory.exists() and overwrite:
        for entry in directory.iterdir():
            if entry.name.startswith(("train-", "validation-", "dedup-", "shard-", "manifest",
                                      "settings", shards.TOKENIZER_DIR)):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous != json.loads(json.dumps(settings)):
            changed = sorted(k for k in settings if previous.get(k) != json.loads(
                json.dumps(settings[k])))
            raise ConfigError(f"option --out {str(directory)!r}: holds a prepare run with other "
                              f"{' and '.join(changed)}; use a new --out, or --overwrite to "
                              "start it again")
    elif directory.exists() and any(directory.iterdir()):
        raise ConfigError(f"option --out {str(directory)!r}: not empty and not a prepare run; "
                          "use a new or empty folder")
    directory.mkdir(parents=True, exist_ok=True)
    shards.write_json(path, settings)
    (directory / shards.MANIFEST).unlink(missing_ok=True)  # incomplete until rewritten


def _batches(files: list[str], options: PrepareOptions, directory: Path,
             bars: _Bars) -> Iterator[_Batch]:
    """The input stream cut into work batches and shards (by characters read)."""
    shard_characters = int(options.shard_megabytes * 1e6)
    shard, characters = 0, 0
    texts: list[str] = []
    errors = ReadErrors()
    skip = shards.finished_marker(directory, shard) is not None
    for path in files:
        for text in read_documents(path, options.inputs, errors):
            if not skip:
                texts.append(text)
            characters += len(text)
            # take(): the reader keeps counting into `errors`, each batch gets what it met
            if characters >= shard_characters:
                yield _Batch(shard, texts, True, errors.take(), skip)
                shard, characters, texts = shard + 1, 0, []
                skip = shards.finished_marker(directory, shard) is not None
            elif len(texts) >= options.batch_documents:
                yield _Batch(shard, texts, False, errors.take(), skip)
                texts = []
        bars.read.update(os.path.getsize(path))
    if characters or texts or errors.counts:
        yield _Batch(shard, texts, True, errors.take(), skip)


def _finish(item, state: _ShardState, directory: Path, exact: set, near, options,
            tokenizer_hash: str, markers: list, bars: _Bars) -> _ShardState:
    """Applies one batch's results in input order; writes the shard at its last batch."""
    batch, work = item
    if batch.skip:
        if batch.last:  # a finished shard: restore its dedup state, reuse its counts
            hashes, signatures = shards.read_dedup_state(shards.dedup_path(directory, batch.shard))
            exact.update(hashes)
            for kept in (signatures if near is not None else ()):
                near.add(kept)
            markers.append(shards.finished_marker(directory, batch.shard))
            bars.shards.update(1)
        return state
    results = work.result() if isinstance(work, concurrent.futures.Future) else work
    state.errors.merge(batch.errors)
    state.documents_read += len(batch.texts)
    for reason, digest, minhash, record, count in results:
        if reason is None and options.dedup.exact:
            reason = "exact_duplicate" if digest in exact else None
            exact.add(digest)
            if reason is None:
                state.hashes.append(digest)
        if reason is None and near is not None:
            if near.is_duplicate(minhash):
                reason = "near_duplicate"
            else:
                state.signatures.append(minhash)
        if reason:
            state.dropped[reason] += 1
            continue
        split = ("validation" if unit_hash(digest.hex(), options.seed)
                 < options.validation_fraction else "train")
        state.records[split].append(record)
        state.tokens[split] += count
    bars.documents.update(len(batch.texts))
    bars.documents.set_postfix(dropped=sum(state.dropped.values()), refresh=False)
    if batch.last:
        markers.append(_write_shard(directory, batch.shard, state, options, tokenizer_hash))
        bars.shards.update(1)
        return _ShardState()
    return state


def _write_shard(directory: Path, index: int, state: _ShardState, options: PrepareOptions,
                 tokenizer_hash: str) -> dict:
    files = {}
    for split, records in state.records.items():
        if records:  # an empty split writes no file (grain cannot open an empty source)
            files[split] = shards.shard_name(split, index)
            shards.write_records(directory / files[split], records)
    shards.write_dedup_state(shards.dedup_path(directory, index), state.hashes,
                             state.signatures, options.dedup.permutations)
    marker = {
        "index": index,
        "files": files,
        "documents_read": state.documents_read,
        "documents": {split: len(records) for split, records in state.records.items()},
        "tokens": {split: state.tokens[split] for split in shards.SPLITS},
        "dropped": dict(state.dropped),
        "read_errors": dict(state.errors.counts),
        "read_error_examples": state.errors.examples,
        "tokenizer_sha256": tokenizer_hash,
    }
    # the marker goes last: its presence is what makes the shard count as finished
    shards.write_json(shards.marker_path(directory, index), marker)
    return marker


def _manifest(inputs: list[str], settings: dict, tokenizer: Tokenizer, tokenizer_hash: str,
              markers: list[dict]) -> dict:
    totals = {key: collections.Counter() for key in ("documents", "tokens", "dropped",
                                                     "read_errors")}
    examples: list[str] = []
    for marker in markers:
        for key, counter in totals.items():
            counter.update(marker[key])
        examples.extend(marker["read_error_examples"][:max(0, 20 - len(examples))])
    return {
        "format": 1,
        "inputs": list(inputs),
        "input_files": len(settings["files"]),
        "settings": settings["options"],
        "tokenizer": {"file": f"{shards.TOKENIZER_DIR}/{Path(tokenizer.path).name}",
                      "sha256": tokenizer_hash,
                      "vocab_size": tokenizer.vocab_size},
        "token_dtype": shards.token_dtype(tokenizer.vocab_size).name,
        "documents_read": sum(m["documents_read"] for m in markers),
        "documents_written": {s: totals["documents"][s] for s in shards.SPLITS},
        "tokens_written": {s: totals["tokens"][s] for s in shards.SPLITS},
        "dropped": dict(sorted(totals["dropped"].items())),
        "read_errors": dict(sorted(totals["read_errors"].items())),
        "read_error_examples": examples,
        "shards": [{"index": m["index"], "files": m["files"], "documents": m["documents"],
                    "tokens": m["tokens"]} for m in markers],
    }


class _Bars:
    """One tqdm bar per stage: bytes read, documents cleaned and deduplicated, shards written."""

    def __init__(self, total_bytes: int, enabled: bool):
        common = dict(disable=not enabled, file=sys.stderr, dynamic_ncols=True, leave=True)
        self.read = tqdm(total=total_bytes, desc="read", unit="B", unit_scale=True,
                         position=0, **common)
        self.documents = tqdm(desc="clean+dedup", unit="doc", unit_scale=True, position=1,
                              **common)
        self.shards = tqdm(desc="write", unit="shard", position=2, **common)

    def close(self) -> None:
        for bar in (self.read, self.documents, self.shards):
            bar.close()
