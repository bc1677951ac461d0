"""What `maxmoe generate` decodes: prompt ids from text (with the run's tokenizer) or from an
ids file, the ids it pads with and stops at, and the longest sequence the model takes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from maxmoe.config import Config, ConfigError
from maxmoe.data.tokenizer import check_vocab_size, open_tokenizer


def find_tokenizer(ckpt: Path, given: str | None, vocab_size: int):
    """The Tokenizer of --tokenizer DIR, else of <ckpt>/tokenizer (a run saves it there), else
    None. Raises ConfigError when --tokenizer is unusable or has more ids than the model."""
    if not given and not (ckpt / "tokenizer").exists():
        return None
    tokenizer = (open_tokenizer(given, "--tokenizer") if given
                 else open_tokenizer(ckpt / "tokenizer"))
    check_vocab_size(tokenizer, vocab_size)
    return tokenizer


def text_prompts(texts: list[str], prompts_file: str | None, tokenizer) -> list[list[int]]:
    """--prompt texts and the lines of --prompts-file (blank lines skipped), encoded."""
    if prompts_file:
        if not Path(prompts_file).is_file():
            raise ConfigError(f"--prompts-file {prompts_file!r}: not found; pass a text file "
                              "with one prompt per line")
        texts = texts + [line for line in Path(prompts_file).read_text().splitlines()
                         if line.strip()]
    if not texts:
        raise ConfigError("no prompt given: pass --prompt TEXT, --prompts-file FILE or "
                          "--input ids.npy")
    if tokenizer is None:
        raise ConfigError("text prompts need a tokenizer: none found in the checkpoint's "
                          "tokenizer/ directory; pass --tokenizer DIR, or ids with --input")
    return [list(tokenizer.encode(t)) for t in texts]


def id_prompts(path: str, pad_id: int | None) -> list[list[int]]:
    """Prompt ids of --input: a .npy of ints [B, P] or [P] (with --pad-id, each row's leading
    pad ids are its left padding), or a .npz of 1-D int arrays, one prompt each, in order
    (np.savez(path, *prompts): ragged prompts)."""
    if not Path(path).is_file():
        raise ConfigError(f"--input {path!r}: not found; pass a .npy of token ids [B, P] or an "
                          ".npz of 1-D id arrays")
    try:
        data = np.load(path, allow_pickle=False)
    except ValueError as e:
        raise ConfigError(f"--input {path!r}: unreadable ({e}); pass a .npy or .npz of "
                          "ids") from None
    arrays = ([data[k] for k in data.files] if isinstance(data, np.lib.npyio.NpzFile)
              else list(data if data.ndim == 2 else data[None]))
    if not arrays or any(a.ndim != 1 or not np.issubdtype(a.dtype, np.integer) or not a.size
                         for a in arrays):
        raise ConfigError(f"--input {path!r}: expected non-empty integer id rows ([B, P], [P] "
                          "or an .npz of 1-D arrays)")
    rows = [a.tolist() for a in arrays]
    if pad_id is not None and not isinstance(data, np.lib.npyio.NpzFile):
        rows = [row[next((i for i, t in enumerate(row) if t != pad_id), len(row)):]
                for row in rows]
        if any(not row for row in rows):
            raise ConfigError(f"--input {path!r}: a row is all --pad-id {pad_id}; give every "
                              "prompt at least one token")
    return rows


def max_positions(cfg: Config, hf_config: dict | None) -> int:
    """The longest sequence (prompt + new tokens) the model takes: the source HF config's
    max_position_embeddings, else YaRN's extended length, else the RoPE's pretraining length
    (attention.rope_original_max_positions)."""
    if hf_config and hf_config.get("max_position_embeddings"):
        return int(hf_config["max_position_embeddings"])
    a = cfg.attention
    if a.rope_scaling != "none":
        return int(a.rope_original_max_positions * a.rope_factor)
    return a.rope_original_max_positions


def check_prompts(prompts: list[list[int]], new_tokens: int, limit: int, vocab: int) -> None:
    """Raises ConfigError when an id is outside the vocabulary, or a prompt (or prompt +
    new_tokens) is longer than the model's `limit` positions."""
    longest = max(len(p) for p in prompts)
    bad = [t for p in prompts for t in p if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"prompt token id {bad[0]} is outside the model's vocabulary "
                          f"[0, {vocab}); check --input or the tokenizer")
    if longest > limit:
        raise ConfigError(f"prompt of {longest} tokens is longer than the model's "
                          f"{limit} positions; shorten it")
    if longest + new_tokens > limit:
        raise ConfigError(f"prompt of {longest} tokens + --max-new-tokens {new_tokens} exceeds "
                          f"the model's {limit} positions; lower --max-new-tokens to "
                          f"{limit - longest}")
