"""On-disk layout of a prepared dataset: ArrayRecord shards of token ids, markers, manifest.

    OUT/manifest.json               written last: the dataset is complete once it exists
    OUT/tokenizer/tokenizer.model   the tokenizer the ids belong to (hash in the manifest)
    OUT/train-00007.array_record    one record per document: its token ids, no eos
    OUT/validation-00007.array_record
    OUT/shard-00007.done.json       shard 7's counts (task 7 of the write stage)
    OUT/settings.json, OUT/logs/    the run's settings; datatrove's completions, stats, logs

Every file is written under a temporary name and renamed into place, so an interrupted task
leaves whole files or debris that its rerun overwrites.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from maxmoe.config import ConfigError

MANIFEST = "manifest.json"
SETTINGS = "settings.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "validation")
# group_size:1 lets grain read any single record without decoding its neighbours.
_WRITER_OPTIONS = "group_size:1"


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.array_record"


def marker_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.done.json"


def token_dtype(vocab_size: int) -> np.dtype:
    # uint16 halves the disk and read bandwidth of every vocabulary below 65536 pieces.
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def file_hash(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_records(path: Path, records: list[bytes]) -> None:
    """Writes `records` to the ArrayRecord file `path` atomically."""
    temporary = path.with_name(path.name + ".tmp")
    writer = ArrayRecordWriter(str(temporary), _WRITER_OPTIONS)
    for record in records:
        writer.write(record)
    writer.close()
    os.replace(temporary, path)


def write_json(path: Path, value: dict) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(value, indent=1, sort_keys=False))
    os.replace(temporary, path)


def is_prepared(path: str) -> bool:
    """True when `path` is a folder written by `maxmoe data prepare` (it has a manifest)."""
    return bool(path) and os.path.isfile(os.path.join(os.path.expanduser(path), MANIFEST))


def load_manifest(path: str) -> dict:
    manifest_path = os.path.join(os.path.expanduser(path), MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"prepared dataset {path!r}: cannot read {MANIFEST} ({e}); "
                          "run 'maxmoe data prepare' into it again") from None
    if manifest.get("format") != 1:
        raise ConfigError(f"prepared dataset {path!r}: unknown manifest format "
                          f"{manifest.get('format')!r}; prepare it again with this maxmoe")
    return manifest


def split_files(path: str, manifest: dict, split: str) -> list[str]:
    """Absolute paths of the non-empty shard files of `split`, in shard order."""
    root = os.path.abspath(os.path.expanduser(path))
    files = [os.path.join(root, shard["files"][split]) for shard in manifest["shards"]
             if split in shard["files"]]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ConfigError(f"prepared dataset {path!r}: shard {missing[0]} is missing; "
                          "re-run 'maxmoe data prepare' with the same --out to rewrite it")
    return files


def decode_record(record: bytes, dtype: np.dtype) -> np.ndarray:
    return np.frombuffer(record, dtype=dtype)
