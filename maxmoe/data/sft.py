"""Fine-tuning data (data.format=sft): JSONL chat records read straight from a glob of files.

`data.source` is a glob of JSON-lines files (not a `maxmoe data prepare` folder: prepared
records hold token ids only, no mask). Each line is one record, either

    {"messages": [{"role": "system" | "user" | "assistant" | ..., "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}

A prompt/completion pair is the conversation [user: prompt, assistant: completion]; lists of
messages in `prompt` and `completion` are joined (the completion's assistant turns trained).
In `messages` every assistant turn is trained. A record becomes one packed document (the
pipeline's segment_ids keep documents apart) whose loss_mask is 1 exactly where the target is
a trained token: the answer and the end of its turn (the template's end-of-turn tokens, or
EOS in the default format of data/chat.py).

Listing reads every line once: a line that is not JSON, or a record of neither form, is a
ConfigError naming the file and line; a record without a trained turn is skipped and counted
(one line on stderr), and a source where no record has one is a ConfigError. Records are split
into train and validation by a hash of (file, line), like files are for text sources.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import grain
import numpy as np

from maxmoe.config import ConfigError, DataConfig, fail
from maxmoe.data.chat import TemplateError, conversation_ids
from maxmoe.data.corpus import STDLIB, document_keys, list_documents, unit_hash
from maxmoe.data.tokenizer import Tokenizer

Record = tuple[str, int, int]  # (file, byte offset of the line, line number from 1)


def conversation(record, where: str) -> tuple[list[dict], list[bool]]:
    """(messages, trained per message) of one parsed record; ConfigError naming `where`
    (file:line) when it has neither form."""
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        messages = [_message(m, where) for m in record["messages"]]
        return messages, [m["role"] == "assistant" for m in messages]
    if isinstance(record, dict) and "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return ([{"role": "user", "content": prompt},
                     {"role": "assistant", "content": completion}], [False, True])
        if isinstance(prompt, list) and isinstance(completion, list):
            head = [_message(m, where) for m in prompt]
            tail = [_message(m, where) for m in completion]
            return head + tail, [False] * len(head) + [m["role"] == "assistant" for m in tail]
    raise ConfigError(f"data.source {where}: the record has neither 'messages' (a list of "
                      "{role, content}) nor 'prompt' and 'completion' (strings, or lists of "
                      "messages); fix that line")


def _message(message, where: str) -> dict:
    if (isinstance(message, dict) and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)):
        return message
    raise ConfigError(f"data.source {where}: a message is not {{'role': str, 'content': str}} "
                      f"({json.dumps(message)[:80]}); fix that line")


@functools.lru_cache(maxsize=4)
def _index(source: str, paths: tuple[str, ...], stamps: tuple) -> tuple[Record, ...]:
    """The records with a trained turn of `paths` (matched by `source`); those without one
    are counted on stderr, once (cached). `stamps` (sizes, mtimes) only make the cache forget
    files that changed."""
    del stamps
    records: list[Record] = []
    skipped = 0
    for path in paths:
        with open(path, "rb") as f:
            offset = 0
            for number, line in enumerate(f, 1):
                start, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    parsed = json.loads(line.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise ConfigError(f"data.source {where}: not a JSON line ({e}); fix or "
                                      "remove that line") from None
                if any(conversation(parsed, where)[1]):
                    records.append((path, start, number))
                else:
                    skipped += 1
    if not records:
        fail("data.source", source, None, f"none of its {skipped} records has an assistant "
             "turn (or completion) to train on", "add answers to the records")
    if skipped:
        print(f"maxmoe: data.source {source!r}: skipped {skipped} of {skipped + len(records)} "
              "records without an assistant turn", file=sys.stderr)
    return tuple(records)


def _listing(cfg: DataConfig) -> tuple[str, tuple[str, ...], tuple]:
    """(source, its files, their sizes and mtimes): what the cached functions below key on."""
    if cfg.source == STDLIB or cfg.mixture.strip():
        fail("data.source", cfg.source, None, "data.format=sft reads JSONL chat records",
             "set data.source to a glob of .jsonl files (and data.mixture='')")
    paths = list_documents(cfg.source)
    stamps = tuple((os.path.getsize(p), os.path.getmtime(p)) for p in paths)
    return cfg.source, tuple(paths), stamps


def list_records(cfg: DataConfig) -> list[Record]:
    """Every record of cfg.source with a trained turn, in file and line order."""
    return list(_index(*_listing(cfg)))


@functools.lru_cache(maxsize=4)
def _split(source: str, paths: tuple[str, ...], stamps: tuple, validation_fraction: float,
           seed: int) -> tuple[tuple[Record, ...], tuple[Record, ...]]:
    """(train, validation) records: validation holds those whose (file, line) hashes below
    the fraction, at least one when there are two or more. Cached: every stream asks."""
    records = _index(source, paths, stamps)
    files = sorted({path for path, _, _ in records})
    keys = dict(zip(files, document_keys(files), strict=True))  # machine-independent names
    scores = [unit_hash(f"{keys[path]}:{number}", seed) for path, _, number in records]
    held = {i for i, s in enumerate(scores) if s < validation_fraction}
    if validation_fraction > 0 and not held and len(records) >= 2:
        held = {int(np.argmin(scores))}
    train = tuple(r for i, r in enumerate(records) if i not in held)
    if not train:
        fail("data.validation_fraction", validation_fraction, None,
             f"leaves no training records out of {len(records)}", "lower it")
    return train, tuple(r for i, r in enumerate(records) if i in held)


def records_for(cfg: DataConfig, split: str, process_index: int = 0,
                process_count: int = 1) -> list[Record]:
    """The records of `split` that process `process_index` of `process_count` reads (strided,
    so the shares are disjoint and differ in size by at most one)."""
    train, validation = _split(*_listing(cfg), cfg.validation_fraction, cfg.seed)
    return list(train if split == "train" else validation)[process_index::process_count]


def check_renders(tokenizer: Tokenizer, record: Record) -> None:
    """Renders one record, so that a chat template that cannot mark answers fails before
    training starts, as a ConfigError naming the record."""
    SftDocument(tokenizer).map(record)


class SftDocument(grain.transforms.Map):
    """(file, offset, line) -> {'tokens', 'targets', 'loss_mask'} of that record."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    def map(self, record: Record) -> dict[str, np.ndarray] | None:
        path, offset, number = record
        with open(path, "rb") as f:
            f.seek(offset)
            line = f.readline()
        where = f"{path}:{number}"
        messages, trained = conversation(json.loads(line.decode("utf-8")), where)
        try:
            ids, flags = conversation_ids(self._tokenizer, messages, trained)
        except TemplateError as e:
            raise ConfigError(f"data.source {where}: {e}; fix the record, or use a tokenizer "
                              "whose chat_template renders it") from None
        return document_features(ids, flags)


def document_features(ids: list[int], flags: list[bool]) -> dict[str, np.ndarray] | None:
    """tokens = ids, targets = ids[1:] + [0], loss_mask[i] = 1 where target i (= ids[i+1]) is
    trained; the last position has no target within the document. None (dropped by the
    pipeline) when nothing is trained."""
    count = len(ids)
    if not any(flags[1:]):
        return None
    tokens = np.asarray(ids, np.int32)
    targets = np.zeros(count, np.int32)
    targets[:-1] = tokens[1:]
    loss_mask = np.zeros(count, np.float32)
    loss_mask[:-1] = np.asarray(flags[1:], np.float32)
    return {"tokens": tokens, "targets": targets, "loss_mask": loss_mask}
