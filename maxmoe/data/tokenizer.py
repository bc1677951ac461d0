"""Tokenizers: `open_tokenizer` loads a SentencePiece model or a Hugging Face tokenizer folder
(hf_tokenizer.py); `load_tokenizer` loads the one a config names, or trains a SentencePiece
model on the corpus once and caches it.

Every tokenizer has encode(text) -> ids (no special tokens added), decode(ids) -> text,
vocab_size, bos_id / eos_id / pad_id (int or None), chat_template (str or None), sha256 (what
prepared data checks) and save(directory), which writes what open_tokenizer reads back.

SentencePiece training settings are chosen for source code as much as prose: byte-level BPE
(byte_fallback, so any text round-trips and nothing is <unk>), identity normalisation and no
whitespace squeezing (indentation and newlines carry meaning in code), whitespace-only pieces (a run of
spaces becomes one token) and single digits (numbers tokenise consistently).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Protocol

import sentencepiece as spm

from maxmoe.config import ConfigError, DataConfig, describe, fail
from maxmoe.data.corpus import document_keys, list_documents, read_document, unit_hash
from maxmoe.data.hf_tokenizer import (
    CONFIG_JSON,
    TOKENIZER_JSON,
    HFTokenizer,
    is_hf_tokenizer_file,
)
from maxmoe.data.shards import TOKENIZER_DIR, file_hash, is_prepared

MODEL_FILE = "tokenizer.model"
RUN_TOKENIZER_DIR = "tokenizer"  # <run.dir>/tokenizer: the run's tokenizer, for generate and eval
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3

# Everything that changes the trained model goes into the cache key below; bump
# `version` when the sampling code changes in a way these numbers do not capture.
_TRAINER_SETTINGS = dict(
    model_type="bpe",
    byte_fallback=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,  # a leading space would not survive decode(encode(x))
    allow_whitespace_only_pieces=True,
    split_digits=True,
    character_coverage=0.9995,
    pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
)
_SAMPLE_SETTINGS = dict(
    version=1,
    sample_bytes=4_000_000,  # about 0.5 s of BPE training for vocab 2048 on 2 cores
    chunk_chars=2_000,  # training "sentences": line-aligned chunks, so newlines get merged
    sample_seed=0,
)


class Tokenizer(Protocol):
    """What the data pipeline, prepare, generate and eval need of a tokenizer."""
    path: str  # the file the ids come from (tokenizer.model or tokenizer.json)
    vocab_size: int  # ids are < vocab_size
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    chat_template: str | None  # a jinja chat template (transformers' convention) or None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...

    @property
    def sha256(self) -> str: ...

    def save(self, directory: str | os.PathLike) -> None: ...


class SentencePieceTokenizer:
    """A loaded SentencePiece model. Picklable (by path), so grain workers can rebuild it."""

    chat_template = None  # SentencePiece models carry none; SFT uses data/chat.py's default

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self.directory = os.path.dirname(self.path)
        self._processor = spm.SentencePieceProcessor(model_file=self.path)
        self.vocab_size = self._processor.get_piece_size()
        # SentencePiece says -1 for a token the model was trained without
        self.pad_id, self.eos_id, self.bos_id = (
            i if i >= 0 else None for i in (self._processor.pad_id(), self._processor.eos_id(),
                                            self._processor.bos_id()))

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def decode(self, ids) -> str:
        # Control ids (pad, bos, eos) decode to nothing, so packed rows decode cleanly.
        return self._processor.decode([int(i) for i in ids])

    @property
    def sha256(self) -> str:
        """The hash of the model file (prepared data records it in its manifest)."""
        return file_hash(self.path)

    def save(self, directory: str | os.PathLike) -> None:
        """Copies the model to `directory`/tokenizer.model (what open_tokenizer reads)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        if Path(self.path).resolve() != (out / MODEL_FILE).resolve():
            shutil.copyfile(self.path, out / MODEL_FILE)

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(path={self.path!r}, vocab_size={self.vocab_size})"


def open_tokenizer(path: str | os.PathLike, subject: str = "") -> Tokenizer:
    """The tokenizer at `path`: a folder (or a file in it) holding a Hugging Face tokenizer
    (tokenizer.json with tokenizer_config.json, or tokenizer.json alone) or a SentencePiece
    tokenizer.model. A folder with both kinds is read as Hugging Face when it has
    tokenizer_config.json (released models ship tokenizer.model beside it), else as
    SentencePiece. `subject` (default "tokenizer 'PATH'") starts the one-line ConfigError when
    nothing is there, e.g. the config key that named `path`."""
    given = Path(path).expanduser()
    if given.is_file():
        if given.name.endswith(".json") and is_hf_tokenizer_file(given):
            return HFTokenizer(given.parent)
        return SentencePieceTokenizer(given)
    hf_file = given / TOKENIZER_JSON
    hf = hf_file.is_file() and is_hf_tokenizer_file(hf_file)
    if hf and (given / CONFIG_JSON).is_file():
        return HFTokenizer(given)
    if (given / MODEL_FILE).is_file():
        return SentencePieceTokenizer(given / MODEL_FILE)
    if hf:
        return HFTokenizer(given)
    subject = subject or f"tokenizer {str(path)!r}"
    raise ConfigError(f"{subject}: found neither {MODEL_FILE} (SentencePiece) nor "
                      f"{TOKENIZER_JSON} (Hugging Face, with {CONFIG_JSON}) there; point it at "
                      "a folder holding one of them")


def save_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike) -> Path:
    """Writes `tokenizer` (with its chat template) into `directory`, replacing what is there:
    a run's <run.dir>/tokenizer/, which generate and eval open. Written into a private folder
    first and renamed into place, so a reader never sees half of it. Returns the folder."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        tokenizer.save(staging)
        if directory.exists():
            shutil.rmtree(directory)
        os.rename(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def check_vocab_size(tokenizer: Tokenizer, vocab_size: int) -> None:
    """A tokenizer may have fewer ids than the model's embedding (released models pad it),
    never more: one-line ConfigError naming both sizes."""
    if tokenizer.vocab_size > vocab_size:
        fail("model.vocab_size", vocab_size, None, f"the tokenizer at {tokenizer.path} has "
             f"{tokenizer.vocab_size} tokens, more than the model's {vocab_size}",
             f"set model.vocab_size to at least {tokenizer.vocab_size}")


def cache_root() -> Path:
    """Where trained tokenizers are cached: $MAXMOE_CACHE or ~/.cache/maxmoe."""
    return Path(os.environ.get("MAXMOE_CACHE") or Path.home() / ".cache" / "maxmoe")


def load_tokenizer(cfg: DataConfig, vocab_size: int) -> Tokenizer:
    """The tokenizer in cfg.tokenizer_dir, or the one a prepared dataset was tokenized with,
    or one trained on cfg.source (cached on disk)."""
    directory = cfg.tokenizer_dir or _prepared_tokenizer_dir(cfg)
    if directory:
        tokenizer = open_tokenizer(directory, describe("data.tokenizer_dir", directory))
        check_vocab_size(tokenizer, vocab_size)
        return tokenizer

    paths = list_documents(cfg.source)
    directory = cache_root() / "tokenizers" / _cache_key(paths, vocab_size)
    if not (directory / MODEL_FILE).is_file():
        _train_into(directory, cfg.source, paths, vocab_size)
    return SentencePieceTokenizer(directory / MODEL_FILE)


def _prepared_tokenizer_dir(cfg: DataConfig) -> str:
    """The tokenizer folder inside the (first) prepared dataset of cfg, or ''."""
    try:
        first = next(iter(cfg.mixture_weights()))
    except ValueError as e:
        fail("data.mixture", cfg.mixture, None, str(e), "write e.g. 'data/web:0.7,data/code:0.3'")
    return os.path.join(first, TOKENIZER_DIR) if is_prepared(first) else ""


def _cache_key(paths: list[str], vocab_size: int) -> str:
    # Path and size identify the corpus without reading it; mtimes are left out because a
    # reinstall touches them without changing the text.
    identity = {
        "files": [(p, os.path.getsize(p)) for p in paths],
        "vocab_size": vocab_size,
        "trainer": _TRAINER_SETTINGS,
        "sample": _SAMPLE_SETTINGS,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _sample_sentences(paths: list[str]) -> tuple[list[str], int]:
    """Line-aligned chunks of a hash-ordered sample of documents, and the sample's size."""
    keys = document_keys(paths)
    seed = _SAMPLE_SETTINGS["sample_seed"]
    order = sorted(range(len(paths)), key=lambda i: unit_hash(keys[i], seed))
    sentences: list[str] = []
    total = 0
    for i in order:
        text = read_document(paths[i])
        if not text:
            continue
        sentences.extend(sentence_chunks(text))
        total += len(text)
        if total >= _SAMPLE_SETTINGS["sample_bytes"]:
            break
    return sentences, total


def sentence_chunks(text: str) -> list[str]:
    """Line-aligned chunks of at most chunk_chars characters: the trainer's "sentences"."""
    chunk_chars = _SAMPLE_SETTINGS["chunk_chars"]
    chunks: list[str] = []
    current = ""
    for line in text.splitlines(keepends=True):
        if current and len(current) + len(line) > chunk_chars:
            chunks.append(current)
            current = ""
        current += line[: chunk_chars]  # a single huge line must not exceed the limit
    if current:
        chunks.append(current)
    return chunks


def train_model(sentences: list[str], vocab_size: int, *, problem_key: str, sample: str,
                model_type: str = "bpe") -> bytes:
    """The serialized SentencePiece model trained on `sentences` with the settings above.

    `problem_key` and `sample` name the setting and the data in the one-line error.
    """
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=vocab_size,
            # utf-8 can take 4 bytes a character; longer sentences would be dropped silently.
            max_sentence_length=4 * _SAMPLE_SETTINGS["chunk_chars"] + 16,
            input_sentence_size=0,  # use every sentence: the sample above is the size cap
            num_threads=max(1, os.cpu_count() or 1),
            minloglevel=2,  # the trainer's own log is pages long; one line below suffices
            **{**_TRAINER_SETTINGS, "model_type": model_type},
        )
    except RuntimeError as e:
        raise ConfigError(
            f"{problem_key}: SentencePiece could not train on {sample} "
            f"({str(e).strip().splitlines()[-1]}); use a smaller vocabulary or a larger "
            "corpus") from None
    return model.getvalue()


def _train_into(directory: Path, source: str, paths: list[str], vocab_size: int) -> None:
    start = time.perf_counter()
    sentences, sample_chars = _sample_sentences(paths)
    if not sentences:
        fail("data.source", source, None, f"no readable UTF-8 text in {len(paths)} files",
             "point it at text files")
    model = train_model(sentences, vocab_size, problem_key=describe("model.vocab_size", vocab_size),
                        sample=f"{sample_chars / 1e6:.2f} MB of {source!r}")

    # Train into a private folder and rename it into place: a concurrent or interrupted run
    # never sees a half-written model, and the first finished writer wins.
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        (staging / MODEL_FILE).write_bytes(model)
        (staging / "tokenizer.json").write_text(json.dumps({
            "source": source, "num_files": len(paths), "sample_chars": sample_chars,
            "vocab_size": vocab_size, "trainer": _TRAINER_SETTINGS, "sample": _SAMPLE_SETTINGS,
        }, indent=1))
        try:
            os.rename(staging, directory)
        except OSError:
            if not (directory / MODEL_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    seconds = time.perf_counter() - start
    print(f"maxmoe: trained a {vocab_size}-piece tokenizer on {sample_chars / 1e6:.1f} MB of "
          f"{source!r} in {seconds:.1f} s -> {directory / MODEL_FILE}", file=sys.stderr)
