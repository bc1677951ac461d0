"""maxmoe's own work as datatrove pipeline steps: reading, cleaning, decontamination, shards.

Each class is one datatrove PipelineStep (or BaseFilter) so that the same pipeline runs under
datatrove's Local, Ray and Slurm executors (prepare.py builds the stages). A filter drops a
document with a reason; datatrove counts it as `dropped_<reason>` in the task's stats, which
the manifest step sums. Everything a step needs (tokenizer, language model, n-gram sets) is
loaded lazily inside the task, so steps pickle small and load once per worker.
"""

from __future__ import annotations

import collections
import hashlib
import re
from pathlib import Path

import numpy as np
from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.filters.base_filter import BaseFilter

from maxmoe.data import shards
from maxmoe.data.corpus import unit_hash
from maxmoe.data.filters import (
    FilterOptions,
    character_filter,
    content_hash,
    language_filter,
    normalize,
    token_filter,
)
from maxmoe.data.sources import InputOptions, ReadErrors, read_documents

WORD = re.compile(r"\w+")
DECONTAMINATION_NGRAM = 13  # words; the n-gram GPT-3 and later reports use for overlap


class InputReader(PipelineStep):
    """Task `rank` reads files[rank::world_size] with maxmoe's readers (text, JSON lines,
    Parquet, gzip/zstd), counting bad files and lines instead of failing on them; their first
    examples go to `errors_dir`/{rank}.json for the manifest."""

    type = "📖 - READER"
    name = "maxmoe inputs"

    def __init__(self, files: list[str], options: InputOptions, errors_dir: str):
        super().__init__()
        self.files, self.options, self.errors_dir = files, options, errors_dir

    def run(self, data: DocumentsPipeline = None, rank: int = 0,
            world_size: int = 1) -> DocumentsPipeline:
        errors = ReadErrors()
        count = 0
        for path in self.files[rank::world_size]:
            for text in read_documents(path, self.options, errors):
                self.stat_update("documents_read")
                yield Document(text=text, id=f"{rank}/{count}")
                count += 1
        for kind, n in errors.counts.items():
            self.stat_update(f"read_error_{kind}", value=n)
        Path(self.errors_dir).mkdir(parents=True, exist_ok=True)
        shards.write_json(Path(self.errors_dir) / f"{rank:05d}.json",
                          {"counts": dict(errors.counts), "examples": errors.examples})


class Normalize(PipelineStep):
    """Unicode normalisation (FilterOptions.normalization) of every document's text."""

    type = "🔨 - FORMAT"
    name = "maxmoe normalize"

    def __init__(self, options: FilterOptions):
        super().__init__()
        self.options = options

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1):
        for doc in data:
            doc.text = normalize(doc.text, self.options)
            yield doc


class CharacterFilter(BaseFilter):
    """Drops empty documents and those outside the character limits (filters.py)."""

    name = "maxmoe characters"

    def __init__(self, options: FilterOptions):
        super().__init__()
        self.options = options

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        reason = character_filter(doc.text, self.options)
        return (False, reason) if reason else True


class LanguageFilter(BaseFilter):
    """Keeps the languages of FilterOptions.languages (py3langid, offline; filters.py)."""

    name = "maxmoe language"

    def __init__(self, options: FilterOptions):
        super().__init__()
        self.options = options

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        reason = language_filter(doc.text, self.options)
        return (False, reason) if reason else True


def ngram_hashes(text: str, n: int) -> set[int]:
    """64-bit hashes of the lower-cased word n-grams of `text` (none when it is shorter)."""
    words = WORD.findall(text.lower())
    return {int.from_bytes(hashlib.blake2b(" ".join(words[i:i + n]).encode(),
                                           digest_size=8).digest(), "little")
            for i in range(len(words) - n + 1)}


class Decontaminate(BaseFilter):
    """Drops ("contaminated") documents that share a word 13-gram with any evaluation text.

    The evaluation files are read with maxmoe's readers (any input format) inside each task,
    once; the n-gram set costs about 100 bytes per evaluation word.
    """

    name = "maxmoe decontaminate"

    def __init__(self, paths: list[str], options: InputOptions):
        super().__init__()
        self.paths, self.options = paths, options
        self._ngrams: set[int] | None = None

    def filter(self, doc: Document) -> bool | tuple[bool, str]:
        if self._ngrams is None:
            self._ngrams = set()
            for path in self.paths:
                for text in read_documents(path, self.options, ReadErrors()):
                    self._ngrams |= ngram_hashes(text, DECONTAMINATION_NGRAM)
        if self._ngrams.isdisjoint(ngram_hashes(doc.text, DECONTAMINATION_NGRAM)):
            return True
        return False, "contaminated"


class ShardWriter(PipelineStep):
    """The last step of task `rank`: tokenizes the surviving documents, applies the token
    filter, splits train/validation by content hash, and writes OUT/{split}-{rank}.array_record
    with the done marker (shards.py). A rerun of the task rewrites the same files."""

    type = "💽 - WRITER"
    name = "maxmoe shards"

    def __init__(self, out: str, filters: FilterOptions, validation_fraction: float, seed: int):
        super().__init__()
        self.out, self.filters = out, filters
        self.validation_fraction, self.seed = validation_fraction, seed

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1):
        from maxmoe.data.tokenizer import open_tokenizer  # late: loaded in the task only

        directory = Path(self.out)
        tokenizer = open_tokenizer(directory / shards.TOKENIZER_DIR)
        dtype = shards.token_dtype(tokenizer.vocab_size)
        records = {split: [] for split in shards.SPLITS}
        tokens = collections.Counter()
        for doc in data or ():
            with self.track_time():
                ids = tokenizer.encode(doc.text)
                reason = token_filter(len(ids), self.filters)
                if reason:
                    self.stat_update("dropped", f"dropped_{reason}")
                    continue
                split = ("validation" if unit_hash(content_hash(doc.text).hex(), self.seed)
                         < self.validation_fraction else "train")
                records[split].append(np.asarray(ids, dtype).tobytes())
                tokens[split] += len(ids)
        files = {}
        for split, kept in records.items():
            if kept:  # an empty split writes no file (grain cannot open an empty source)
                files[split] = shards.shard_name(split, rank)
                shards.write_records(directory / files[split], kept)
        shards.write_json(shards.marker_path(directory, rank), {
            "index": rank, "files": files,
            "documents": {split: len(kept) for split, kept in records.items()},
            "tokens": {split: tokens[split] for split in shards.SPLITS}})
        return ()
