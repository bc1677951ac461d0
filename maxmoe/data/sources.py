"""Raw inputs of `maxmoe data prepare`/`tokenizer`: listing and reading documents from files.

Inputs are directories (every non-hidden file below them), globs or single files. The format
comes from the name once a compression suffix is removed: `.jsonl`/`.json`/`.ndjson` are JSON
lines (one document per line, text in a chosen field), `.parquet` is Parquet (text in a
chosen column), anything else is plain text (the whole file is one document, or one document
per line). Compression is recognised by its magic bytes, so a mis-named file still reads.

Reading never raises on bad data: an unreadable file, a corrupt compressed stream, invalid
UTF-8 or a malformed JSON line is counted in `ReadErrors` (with a few examples naming the
file) and skipped, because one bad file in a terabyte corpus must not stop the job.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import io
import json
import os
from collections.abc import Iterator

from maxmoe.config import ConfigError

FORMATS = ("auto", "text", "jsonl", "parquet")
_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_COMPRESSION_SUFFIXES = (".gz", ".zst", ".zstd")
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_EXAMPLES_KEPT = 20  # enough to find the bad files, short enough for a manifest


@dataclasses.dataclass(frozen=True)
class InputOptions:
    input_format: str = "auto"  # auto (by file name) | text | jsonl | parquet
    json_field: str = "text"  # field of each JSON line that holds the document
    parquet_column: str = "text"  # Parquet column that holds the documents
    text_document: str = "file"  # plain text: one document per 'file' or per 'line'


class ReadErrors:
    """Counts of skipped inputs by kind, plus the first few examples ('file: reason')."""

    def __init__(self):
        self.counts: collections.Counter[str] = collections.Counter()
        self.examples: list[str] = []

    def add(self, kind: str, path: str, detail: str) -> None:
        self.counts[kind] += 1
        if len(self.examples) < _EXAMPLES_KEPT:
            self.examples.append(f"{path}: {kind} ({detail})")


def list_inputs(inputs: list[str]) -> list[str]:
    """Sorted absolute paths of the files named by `inputs` (directories, globs, files)."""
    if not inputs:
        raise ConfigError("inputs: none given; pass directories, files or quoted globs")
    paths: set[str] = set()
    for item in inputs:
        expanded = os.path.expanduser(item)
        if os.path.isdir(expanded):
            found = _walk(expanded)
        else:
            found = [m for m in glob.glob(expanded, recursive=True) if os.path.isfile(m)]
        if not found:
            raise ConfigError(f"input {item!r}: matches no files; pass an existing directory, "
                              "file or glob (quote globs so the shell does not expand them)")
        paths.update(os.path.abspath(p) for p in found)
    return sorted(paths)


def _walk(directory: str) -> list[str]:
    found = []
    # os.walk does not follow directory symlinks, so a link loop cannot hang the listing;
    # hidden files and folders and __pycache__ are tool debris (.git, .DS_Store, .pyc),
    # never corpus text.
    for folder, subfolders, files in os.walk(directory):
        subfolders[:] = sorted(d for d in subfolders
                               if not d.startswith(".") and d != "__pycache__")
        found.extend(os.path.join(folder, f) for f in files if not f.startswith("."))
    return found


def file_format(path: str, options: InputOptions) -> str:
    if options.input_format != "auto":
        return options.input_format
    name = path.lower()
    for suffix in _COMPRESSION_SUFFIXES:
        name = name.removesuffix(suffix)
    if name.endswith(_JSON_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


def read_documents(path: str, options: InputOptions, errors: ReadErrors) -> Iterator[str]:
    """The documents of one file; problems are counted in `errors`, never raised."""
    kind = file_format(path, options)
    try:
        if kind == "parquet":
            yield from _parquet_documents(path, options, errors)
        elif kind == "jsonl":
            yield from _json_documents(path, options, errors)
        else:
            yield from _text_documents(path, options, errors)
    except (OSError, EOFError, ValueError) as e:
        # Corrupt gzip/zstd streams and truncated files surface mid-read as one of these;
        # documents read before the damage were valid and are kept.
        errors.add("unreadable_file", path, _one_line(e))
    except Exception as e:  # noqa: BLE001 -- pyarrow and zstandard raise their own types
        errors.add("unreadable_file", path, f"{type(e).__name__}: {_one_line(e)}")


def _open_binary(path: str):
    """The decompressed byte stream of `path` (gzip and zstd detected by magic bytes)."""
    raw = open(path, "rb")
    head = raw.peek(4)[:4] if hasattr(raw, "peek") else b""
    if head.startswith(_GZIP_MAGIC):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if head.startswith(_ZSTD_MAGIC):
        import zstandard  # imported on demand: most corpora are not zstd

        # read_across_frames: zstd files are often concatenated frames (pzstd, shards);
        # the buffered wrapper adds the line iteration the zstd reader lacks.
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(
            raw, read_across_frames=True, closefd=True))
    return raw


def _text_documents(path: str, options: InputOptions, errors: ReadErrors) -> Iterator[str]:
    with _open_binary(path) as f:
        if options.text_document == "line":
            for number, line in enumerate(f, 1):
                text = _decode(line, path, number, errors)
                if text is not None and text.strip():
                    yield text.rstrip("\r\n")
            return
        data = f.read()
    text = _decode(data, path, None, errors)
    if text is not None:
        yield text


def _json_documents(path: str, options: InputOptions, errors: ReadErrors) -> Iterator[str]:
    field = options.json_field
    with _open_binary(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            text = _decode(line, path, number, errors)
            if text is None:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                errors.add("malformed_json", f"{path}:{number}", e.msg)
                continue
            value = record.get(field) if isinstance(record, dict) else None
            if not isinstance(value, str):
                errors.add("missing_field", f"{path}:{number}",
                           f"no string field {field!r}; choose it with --json-field")
                continue
            yield value


def _parquet_documents(path: str, options: InputOptions, errors: ReadErrors) -> Iterator[str]:
    import pyarrow.parquet as pq  # imported on demand: pyarrow takes ~0.3 s to import

    column = options.parquet_column
    with _open_binary(path) as f:
        # Parquet needs random access; a compressed wrapper is read into memory first.
        plain = isinstance(f, io.BufferedReader) and isinstance(f.raw, io.FileIO)
        source = f if plain else io.BytesIO(f.read())
        table = pq.ParquetFile(source)
        if column not in table.schema_arrow.names:
            errors.add("missing_field", path, f"no column {column!r} (columns: "
                       f"{', '.join(table.schema_arrow.names)}); choose it with --parquet-column")
            return
        for batch in table.iter_batches(columns=[column], batch_size=1024):
            for value in batch.column(0).to_pylist():
                if isinstance(value, bytes):
                    value = _decode(value, path, None, errors)
                if isinstance(value, str):
                    yield value
                elif value is not None:
                    errors.add("missing_field", path, f"a {type(value).__name__} in {column!r}")


def _decode(data: bytes, path: str, line: int | None, errors: ReadErrors) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"{path}:{line}" if line is not None else path
        errors.add("bad_encoding", where, f"invalid UTF-8 at byte {e.start}")
        return None


def _one_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:200]
