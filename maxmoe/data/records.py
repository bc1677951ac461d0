"""Training input from prepared datasets: this process's documents of each dataset, as grain
MapDatasets of token-id records, plus the weights that turn a mixture into token shares.

The pipeline (pipeline.py) shuffles, repeats, mixes and packs what these functions return.
"""

from __future__ import annotations

import os

import grain
import numpy as np

from maxmoe.config import DataConfig, fail
from maxmoe.data import shards
from maxmoe.data.tokenizer import Tokenizer


def mixture(cfg: DataConfig) -> dict[str, float]:
    """{dataset: weight} of cfg (one entry without a mixture), as a ConfigError on bad text."""
    try:
        return cfg.mixture_weights()
    except ValueError as e:
        fail("data.mixture", cfg.mixture, None, str(e), "write e.g. 'data/web:0.7,data/code:0.3'")


def uses_prepared_data(cfg: DataConfig) -> bool:
    """A mixture (of prepared folders only) or a prepared `source`; else raw text."""
    mixture(cfg)  # a malformed mixture fails here, before any file is read
    return bool(cfg.mixture.strip()) or shards.is_prepared(cfg.source)


class PreparedDataset:
    """One folder written by `maxmoe data prepare`, checked against the training tokenizer."""

    def __init__(self, path: str, tokenizer: Tokenizer, key: str, value: str):
        """key, value: the config setting that named `path` (for the error messages)."""
        if not shards.is_prepared(path):
            fail(key, value, None, f"{path!r} has no {shards.MANIFEST}, so it is not a finished "
                 "'maxmoe data prepare' output", "prepare it (or finish the interrupted run by "
                 "running the same command again)")
        self.path = path
        self.manifest = shards.load_manifest(path)
        expected = self.manifest["tokenizer"]["sha256"]
        if tokenizer.sha256 != expected:
            fail("data.tokenizer_dir", os.path.dirname(tokenizer.path), None,
                 f"the tokenizer there is not the one {path!r} was prepared with",
                 f"leave data.tokenizer_dir empty to use {path}/{shards.TOKENIZER_DIR}, or "
                 "prepare the data with this tokenizer")
        self.dtype = np.dtype(self.manifest["token_dtype"])

    def documents(self, split: str, process_index: int,
                  process_count: int) -> grain.MapDataset:
        """Records (token-id bytes) of `split` that this process reads: every process_count-th
        record from process_index on, so shares are disjoint and differ by at most one."""
        files = shards.split_files(self.path, self.manifest, split)
        if not files:
            return grain.MapDataset.source([])
        source = grain.sources.ArrayRecordDataSource(files)
        return grain.MapDataset.source(source)[process_index::process_count]

    def tokens_per_document(self) -> float:
        documents = self.manifest["documents_written"]["train"]
        return self.manifest["tokens_written"]["train"] / max(documents, 1) + 1  # + eos


def document_weights(datasets: list[PreparedDataset], token_shares: list[float]) -> list[float]:
    """Per-document sampling weights that give each dataset its share of *tokens*.

    grain mixes by elements (documents); a dataset of long documents would otherwise take
    more than its share of every batch.
    """
    raw = [share / dataset.tokens_per_document()
           for dataset, share in zip(datasets, token_shares, strict=True)]
    total = sum(raw)
    return [w / total for w in raw]
