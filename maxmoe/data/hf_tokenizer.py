"""Hugging Face tokenizers: a folder with `tokenizer.json` (read with the `tokenizers` library)
and `tokenizer_config.json` (special tokens and the chat template), as released models ship.

BOS, EOS, pad and unk come from tokenizer_config.json's `bos_token`, `eos_token`, ... entries,
each a string or an AddedToken dict ({"content": ..., ...}); a token missing there, null, or
not in the vocabulary is None. The chat template is the config's `chat_template` (a string, or
transformers' list of named templates, of which "default" or the first is taken), else a
`chat_template.jinja` file next to it (newer transformers write it there).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import tokenizers

from maxmoe.config import ConfigError

TOKENIZER_JSON = "tokenizer.json"
CONFIG_JSON = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def is_hf_tokenizer_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a `tokenizers` JSON file (not, say, maxmoe's SentencePiece notes)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    # the serialized tokenizer always carries its "model" object; maxmoe's SentencePiece
    # training notes (also named tokenizer.json) never do
    return b'"model"' in head or b'"added_tokens"' in head


class HFTokenizer:
    """A tokenizer.json (+ tokenizer_config.json) folder. Picklable (by folder), so grain
    workers can rebuild it.

    encode(text) adds no special tokens (no BOS, no EOS: the pipeline appends EOS, a chat
    template writes its own); special tokens written in the text (e.g. "<|im_start|>") become
    their ids. decode(ids) drops special tokens, as SentencePiece drops its control ids."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = str(directory)
        self.path = str(Path(directory) / TOKENIZER_JSON)
        try:
            self._tokenizer = tokenizers.Tokenizer.from_file(self.path)
        except Exception as e:  # noqa: BLE001 -- the library raises its own exception types
            raise ConfigError(f"tokenizer {self.path!r}: the tokenizers library cannot read it "
                              f"({str(e).strip().splitlines()[0][:200]}); point "
                              "data.tokenizer_dir at a folder holding a valid tokenizer.json"
                              ) from None
        self.config = _read_config(Path(directory) / CONFIG_JSON)
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        # ids may be sparse (added tokens): the embedding needs max id + 1 rows
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self.special_tokens = {key: _token_text(self.config.get(key)) for key in SPECIAL_TOKENS}
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = (
            self._id_of(self.special_tokens[key]) for key in SPECIAL_TOKENS)
        self.chat_template = _chat_template(self.config, Path(directory))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def sha256(self) -> str:
        """Identifies the id mapping: the hash of tokenizer.json (prepared data checks it)."""
        return hashlib.sha256(Path(self.path).read_bytes()).hexdigest()

    def save(self, directory: str | os.PathLike) -> None:
        """Writes tokenizer.json, tokenizer_config.json (with the chat template in it) into
        `directory`, which open_tokenizer reads back as this tokenizer."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        if Path(self.path).resolve() != (out / TOKENIZER_JSON).resolve():
            shutil.copyfile(self.path, out / TOKENIZER_JSON)
        config = dict(self.config)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (out / CONFIG_JSON).write_text(json.dumps(config, indent=1, ensure_ascii=False))

    def __getstate__(self) -> dict:
        return {"directory": self.directory}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["directory"])

    def __repr__(self) -> str:
        return f"HFTokenizer(directory={self.directory!r}, vocab_size={self.vocab_size})"


def _read_config(path: Path) -> dict:
    """tokenizer_config.json as a dict; {} when the folder has none (no special tokens)."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"tokenizer config {str(path)!r}: not readable JSON ({e}); fix or "
                          "delete it") from None
    if not isinstance(config, dict):
        raise ConfigError(f"tokenizer config {str(path)!r}: not a JSON object; fix or delete it")
    return config


def _token_text(value) -> str | None:
    """A special token entry: a string, or an AddedToken dict with its text in "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(config: dict, directory: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if isinstance(template, str) and template:
        return template
    path = directory / TEMPLATE_FILE
    return path.read_text(encoding="utf-8") if path.is_file() else None
