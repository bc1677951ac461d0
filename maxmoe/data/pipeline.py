"""The grain input pipeline: this process's documents -> tokens -> packed rows -> batches.

    documents (this process's share) -> shuffle (seed, reshuffled each epoch) -> repeat
    -> tokenize (lazily, in map) -> concat-then-split packing -> row features -> batch
    -> optional worker processes -> (train) a prefetch thread

`data.source` is raw text (files are documents, tokenized here) or a folder written by
`maxmoe data prepare` (ArrayRecord records are documents, already tokenized); `data.mixture`
mixes several prepared folders by token share (records.py).

Each document becomes `tokens = ids + [eos]`, `targets = ids[1:] + [eos, 0]` and `loss_mask`
(1 where the target counts, 0 at the eos position), computed *before* packing. Packing then
cuts all three features at the same points, so a document split across two rows keeps its true
next token at the row end, and the eos position (whose successor would be another document) is
the only one without a target: the loss never crosses a document boundary and no token pair is
lost at row edges. With data.format=sft the documents are chat records (data/sft.py) whose
loss_mask is 1 only where the target is an assistant / completion token.

Process count and streams: with P processes and `data.streams` = N, process p interleaves the
virtual shares p*N .. p*N+N-1 of P*N, one row of each in turn. So when global_batch_size =
P x N, every global batch (process-major rows, as jax.make_array_from_process_local_data lays
them out) equals, row for row, the batch of one process with data.streams = P x N: the same
run on another process count reads the same batches if data.streams is scaled inversely
(tests/data/test_pipeline.py; tests/distributed/test_multiprocess.py trains 2 x 4 devices and
1 x 8 devices to the same losses). With global_batch_size = k x P x N the batches hold the
same rows in another order. This is for data.num_workers = 0: worker processes each pack
their own slice of the documents, so their batches depend on the worker count.

Batch legend: b local rows (global_batch_size // process_count), S seq_len.
"""

from __future__ import annotations

import functools
from typing import Any

import grain
import numpy as np

from maxmoe.config import DataConfig, fail
from maxmoe.data import records, sft
from maxmoe.data.corpus import list_documents, read_document, split_documents
from maxmoe.data.shards import decode_record
from maxmoe.data.tokenizer import Tokenizer

SPLITS = ("train", "validation")

# Reading threads tokenize ahead of packing. Grain's defaults (16 threads, 500 documents)
# would tokenize megabytes before the first batch on a laptop; a few dozen documents
# ahead already keep a training step fed.
_READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=32)


def batch_spec(cfg: DataConfig,
               process_count: int = 1) -> dict[str, tuple[tuple[int, int], np.dtype]]:
    """(shape, dtype) of each key of one local batch; for abstract shapes before data exists."""
    shape = (local_batch_size(cfg, process_count), cfg.seq_len)
    return {
        "tokens": (shape, np.dtype(np.int32)),  # [b, S] packed input tokens
        "targets": (shape, np.dtype(np.int32)),  # [b, S] next token of the same document, or 0
        "segment_ids": (shape, np.dtype(np.int32)),  # [b, S] 1, 2, ... per piece, 0 = padding
        "positions": (shape, np.dtype(np.int32)),  # [b, S] position within the piece
        "loss_mask": (shape, np.dtype(np.float32)),  # [b, S] 1 where targets is trained on
    }


def local_batch_size(cfg: DataConfig, process_count: int) -> int:
    if process_count < 1 or cfg.global_batch_size % process_count:
        fail("data.global_batch_size", cfg.global_batch_size, None,
             f"not divisible by the {process_count} processes",
             f"use a multiple of {process_count}")
    return cfg.global_batch_size // process_count


def documents_for(cfg: DataConfig, split: str, process_index: int = 0,
                  process_count: int = 1) -> list[str]:
    """The documents of `split` that process `process_index` of `process_count` reads.

    Strided over the sorted list, so the shares are disjoint, cover the split, differ in
    size by at most one document, and each mixes all folders of the corpus.
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {SPLITS}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    train, validation = split_documents(list_documents(cfg.source), cfg.validation_fraction,
                                        cfg.seed)
    return (train if split == "train" else validation)[process_index::process_count]


class _TokenizeDocument(grain.transforms.Map):
    """path -> {'tokens', 'targets'} of one document, or None to skip it."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    def map(self, path: str) -> dict[str, np.ndarray] | None:
        text = read_document(path)
        return _document_features(self._tokenizer.encode(text) if text else [],
                                  self._tokenizer)


class _RecordDocument(grain.transforms.Map):
    """Token-id record of a prepared dataset -> {'tokens', 'targets'}, or None if empty."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype):
        self._tokenizer = tokenizer
        self._dtype = dtype

    def map(self, record: bytes) -> dict[str, np.ndarray] | None:
        return _document_features(decode_record(record, self._dtype), self._tokenizer)


def _document_features(ids, tokenizer: Tokenizer) -> dict[str, np.ndarray] | None:
    if not len(ids):
        # to_iter_dataset drops None elements: unreadable and empty documents vanish here.
        return None
    count = len(ids)
    tokens = np.empty(count + 1, np.int32)
    tokens[:count] = ids
    tokens[count] = tokenizer.eos_id
    targets = np.zeros(count + 1, np.int32)
    # the eos position has no target: its successor belongs to another document
    targets[:count] = tokens[1:]
    loss_mask = np.ones(count + 1, np.float32)
    loss_mask[count] = 0.0
    return {"tokens": tokens, "targets": targets, "loss_mask": loss_mask}


def _row_features(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Renames grain's packing outputs; row padding has loss_mask 0 (the packer pads zeros)."""
    return {
        "tokens": packed["tokens"],
        "targets": packed["targets"],
        "segment_ids": packed["tokens_segment_ids"],
        "positions": packed["tokens_positions"],
        "loss_mask": packed["loss_mask"].astype(np.float32),
    }


def check_eos(tokenizer: Tokenizer) -> None:
    """Packing ends every pretraining document with EOS: a tokenizer without one is a
    config error (naming the tokenizer file)."""
    if tokenizer.eos_id is None:
        fail("data.tokenizer_dir", getattr(tokenizer, "path", "?"), None, "the tokenizer has "
             "no EOS token, which ends every packed document", "set eos_token in its "
             "tokenizer_config.json")


def make_dataset(cfg: DataConfig, tokenizer: Tokenizer, *, split: str = "train",
                 process_index: int = 0, process_count: int = 1,
                 num_epochs: int | None = None) -> grain.IterDataset:
    """This process's batches (dicts of numpy arrays, see `batch_spec`).

    Train repeats `num_epochs` times (None = forever), reshuffled every epoch from
    `cfg.seed`, and drops a last partial batch. Validation is one pass in file order whose
    last batch is padded with empty rows (loss_mask 0) so every batch has one shape. Both
    interleave `cfg.streams` packed streams, so a batch holds rows of many documents.
    `iter(dataset)` supports get_state()/set_state() for exact resumption. Train batches are
    made ahead by a thread, up to `cfg.prefetch_batches` of them (0 = on demand).
    """
    batch_size = local_batch_size(cfg, process_count)
    training = split == "train"
    if not 0 <= cfg.seed < 2**32:
        fail("data.seed", cfg.seed, None, "must be in [0, 2**32)", "pick another")
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {SPLITS}")
    if cfg.format == "sft":
        first = sft.records_for(cfg, "train")[:1]
        if first:
            sft.check_renders(tokenizer, first[0])  # a template that cannot mark answers
    else:
        check_eos(tokenizer)

    def packed_rows(process_index: int, process_count: int) -> grain.IterDataset:
        if cfg.format == "sft":
            dataset = _sft_documents(cfg, tokenizer, split, process_index, process_count,
                                     num_epochs)
        elif records.uses_prepared_data(cfg):
            dataset = _prepared_documents(cfg, tokenizer, split, process_index, process_count,
                                          num_epochs)
        else:
            documents = documents_for(cfg, split, process_index, process_count)
            if training and not documents:
                fail("data.source", cfg.source, None, f"no training documents for stream "
                     f"{process_index} of {process_count} (processes x data.streams)",
                     "use a corpus with more files or lower data.streams")
            dataset = grain.MapDataset.source(documents)
            if training:
                # shuffle-then-repeat: grain folds the epoch into the shuffle seed, so each
                # epoch has its own order and the stream is a pure function of (seed, step).
                dataset = dataset.shuffle(seed=cfg.seed).repeat(num_epochs)
            dataset = dataset.map(_TokenizeDocument(tokenizer))
        rows = grain.experimental.ConcatThenSplitIterDataset(
            dataset.to_iter_dataset(_READ_OPTIONS),
            length_struct={key: cfg.seq_len for key in ("tokens", "targets", "loss_mask")},
        ).map(_row_features)
        return rows

    if cfg.streams > 1:
        # packing keeps a long document in consecutive rows, so a batch of one stream would be
        # one or two files; interleaving `streams` independent streams (each a virtual process
        # share) gives every batch rows of many documents, and resumes exactly. Validation too:
        # its first eval_batches batches then sample many documents, not the first few files
        # of the sorted list (on stdlib, batches 9-20 were two codec tables alone)
        n = cfg.streams
        rows = grain.experimental.InterleaveIterDataset(
            [packed_rows(process_index * n + i, process_count * n) for i in range(n)],
            cycle_length=n)
    else:
        rows = packed_rows(process_index, process_count)
    if training:
        batches = rows.batch(batch_size, drop_remainder=True)
    else:
        batches = rows.batch(batch_size, batch_fn=functools.partial(
            grain.experimental.batch_and_pad, batch_size=batch_size))
    if cfg.num_workers > 0:
        # Each worker packs its own slice of the documents; grain interleaves the workers'
        # batches in a fixed order, so the stream stays deterministic and checkpointable
        # (for the same num_workers).
        batches = batches.mp_prefetch(grain.MultiprocessingOptions(
            num_workers=cfg.num_workers, per_worker_buffer_size=cfg.prefetch_batches))
    if training and cfg.prefetch_batches > 0:
        batches = prefetch(batches, cfg.prefetch_batches)
    return batches


def _sft_documents(cfg: DataConfig, tokenizer: Tokenizer, split: str, process_index: int,
                   process_count: int, num_epochs: int | None) -> grain.MapDataset:
    """Documents ({'tokens', 'targets', 'loss_mask'} or None) of data.format=sft: this
    process's chat records of `split` (data/sft.py), shuffled and repeated for training."""
    chosen = sft.records_for(cfg, split, process_index, process_count)
    if split == "train" and not chosen:
        fail("data.source", cfg.source, None, f"no training records for stream "
             f"{process_index} of {process_count} (processes x data.streams)",
             "use more records or lower data.streams")
    dataset = grain.MapDataset.source(chosen)
    if split == "train":
        dataset = dataset.shuffle(seed=cfg.seed).repeat(num_epochs)
    return dataset.map(sft.SftDocument(tokenizer))


def prefetch(batches: grain.IterDataset, size: int) -> grain.IterDataset:
    """A thread keeps up to `size` batches ready while the train step runs.

    The iterator's get_state() is the position after the batches handed out by next(), not
    after those waiting in the buffer (grain records the state next to each buffered
    element), so a checkpoint taken between steps resumes exactly; set_state() drops the
    buffer and restarts the thread from the new position. The state has the same form as
    the unbuffered pipeline's, so checkpoints written with or without it are interchangeable.
    """
    return grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=size)


def _prepared_documents(cfg: DataConfig, tokenizer: Tokenizer, split: str, process_index: int,
                        process_count: int, num_epochs: int | None) -> grain.MapDataset:
    """Documents ({'tokens', 'targets'} or None) of the prepared dataset(s) in cfg.

    Training shuffles and repeats each dataset on its own, then mixes them with weights that
    give each its share of tokens; validation is one pass over each dataset in turn.
    """
    weights = records.mixture(cfg)
    key, value = ("data.mixture", cfg.mixture) if cfg.mixture.strip() else ("data.source",
                                                                           cfg.source)
    datasets = [records.PreparedDataset(path, tokenizer, key, value) for path in weights]
    parts = []
    for index, dataset in enumerate(datasets):
        documents = dataset.documents(split, process_index, process_count)
        if split == "train":
            if not len(documents):
                fail(key, value, None, f"{dataset.path!r} has no training documents for "
                     f"process {process_index} of {process_count}", "prepare more data")
            # each dataset gets its own shuffle seed, so equal-sized datasets do not move
            # in lockstep
            documents = documents.shuffle(seed=(cfg.seed + index) % 2**32).repeat(num_epochs)
        parts.append(documents.map(_RecordDocument(tokenizer, dataset.dtype)))
    if len(parts) == 1:
        return parts[0]
    if split == "train":
        return grain.MapDataset.mix(parts, records.document_weights(datasets,
                                                                    list(weights.values())))
    return grain.MapDataset.concatenate(parts)


def padding_fraction(batch: dict[str, Any]) -> float:
    """Share of positions in `batch` that hold no token (segment id 0)."""
    segment_ids = np.asarray(batch["segment_ids"])
    return float((segment_ids == 0).mean())
