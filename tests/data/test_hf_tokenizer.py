"""Hugging Face tokenizer folders: open_tokenizer reads them (special tokens and chat template
from tokenizer_config.json), save() writes what it reads back, and the bad inputs of issue 27
(a folder with neither kind, a vocabulary larger than the model's) are one-line ConfigErrors."""

import dataclasses
import json
import pickle
import random

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizerModel

from maxmoe.cli import main
from maxmoe.config import ConfigError, DataConfig
from maxmoe.data.hf_tokenizer import HFTokenizer
from maxmoe.data.pipeline import make_dataset
from maxmoe.data.tokenizer import SentencePieceTokenizer, load_tokenizer, open_tokenizer
from tests.data.conftest import CHATML_TEMPLATE, HF_SPECIALS, english, write_hf_tokenizer


def test_open_reads_specials_template_and_round_trips(hf_tokenizer_dir, tokenizer_dir):
    tokenizer = open_tokenizer(hf_tokenizer_dir)
    assert isinstance(tokenizer, HFTokenizer)
    reference = HFTokenizerModel.from_file(str(hf_tokenizer_dir / "tokenizer.json"))
    # ids as the tokenizers library gives them; the config's AddedToken dict and strings
    assert tokenizer.vocab_size == reference.get_vocab_size(with_added_tokens=True)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == tuple(
        reference.token_to_id(t) for t in ("<s>", "<|im_end|>", "<pad>"))
    assert tokenizer.chat_template == CHATML_TEMPLATE
    text = "the water was here 42\n  der die und"
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text
    # special tokens written in the text are their ids; decode drops them
    marked = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert marked[0] == reference.token_to_id("<|im_start|>") and marked[-1] == tokenizer.eos_id
    assert tokenizer.decode(marked) == "user\nhi"
    # picklable (grain workers), and the SentencePiece dir still opens as SentencePiece
    assert pickle.loads(pickle.dumps(tokenizer)).encode(text) == ids
    sentencepiece = open_tokenizer(tokenizer_dir)
    assert isinstance(sentencepiece, SentencePieceTokenizer) and sentencepiece.chat_template is None


def test_save_writes_what_open_reads(hf_tokenizer_dir, tokenizer_dir, tmp_path):
    tokenizer = open_tokenizer(hf_tokenizer_dir)
    tokenizer.save(tmp_path / "hf")
    again = open_tokenizer(tmp_path / "hf")
    assert (again.vocab_size, again.bos_id, again.eos_id, again.pad_id, again.chat_template) == (
        tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id,
        tokenizer.chat_template)
    assert again.sha256 == tokenizer.sha256
    sentencepiece = open_tokenizer(tokenizer_dir)
    sentencepiece.save(tmp_path / "sp")
    assert open_tokenizer(tmp_path / "sp").sha256 == sentencepiece.sha256


def test_template_list_and_jinja_file(tmp_path):
    listed = write_hf_tokenizer(tmp_path / "listed", config={"eos_token": "</s>", "chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "chat"}]})
    assert open_tokenizer(listed).chat_template == "chat"
    separate = write_hf_tokenizer(tmp_path / "separate", config={"eos_token": "</s>"})
    (separate / "chat_template.jinja").write_text("{{ messages }}")
    opened = open_tokenizer(separate)
    assert opened.chat_template == "{{ messages }}" and opened.bos_id is None
    assert opened.eos_id == HF_SPECIALS.index("</s>")  # trainer order gives specials ids 0..4


def test_bad_folders_and_sizes_are_one_line_errors(hf_tokenizer_dir, tmp_path):
    with pytest.raises(ConfigError, match="neither tokenizer.model .* nor tokenizer.json") as e:
        open_tokenizer(tmp_path)
    assert "\n" not in str(e.value)
    cfg = DataConfig(tokenizer_dir=str(hf_tokenizer_dir))
    size = open_tokenizer(hf_tokenizer_dir).vocab_size
    assert load_tokenizer(cfg, size + 100).vocab_size == size  # a padded embedding is fine
    with pytest.raises(ConfigError, match=f"has {size} tokens, more than the model's {size - 1}"):
        load_tokenizer(cfg, size - 1)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": "broken"}))
    with pytest.raises(ConfigError, match="cannot read it"):
        open_tokenizer(tmp_path)
    no_eos = write_hf_tokenizer(tmp_path / "no_eos", config={})
    with pytest.raises(ConfigError, match="no EOS token"):
        make_dataset(dataclasses.replace(cfg, tokenizer_dir=str(no_eos)), open_tokenizer(no_eos))


def test_pretraining_batches_with_hf_tokenizer(hf_tokenizer_dir, tmp_path):
    rng = random.Random(2)
    for i in range(12):
        (tmp_path / f"{i:02d}.txt").write_text(english(rng, 10 + 7 * i))
    root = tmp_path
    tokenizer = open_tokenizer(hf_tokenizer_dir)
    cfg = DataConfig(source=str(root / "*.txt"), seq_len=64, global_batch_size=4,
                     streams=1, prefetch_batches=1, tokenizer_dir=str(hf_tokenizer_dir))
    batch = next(iter(make_dataset(cfg, tokenizer)))
    real = batch["segment_ids"] > 0
    assert batch["tokens"].max() < tokenizer.vocab_size
    # every eos ends a document: no target there; every other real position has one
    at_eos = (batch["tokens"] == tokenizer.eos_id) & real
    assert at_eos.any() and not batch["loss_mask"][at_eos].any()
    np.testing.assert_array_equal(batch["loss_mask"], (real & ~at_eos).astype(np.float32))


def test_prepare_with_hf_tokenizer_then_train_batches(hf_tokenizer_dir, tmp_path, capsys):
    """`maxmoe data prepare --tokenizer HF_DIR`: the shards hold that tokenizer's ids, the
    folder carries the tokenizer, and the pipeline reads it back from there."""
    rng = random.Random(5)
    texts = [f"doc {i} " + english(rng, 40) for i in range(60)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "prepared"
    assert main(["data", "prepare", str(tmp_path / "docs.jsonl"), "--tokenizer",
                 str(hf_tokenizer_dir), "--out", str(out), "--workers", "1",
                 "--no-near-dedup"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    tokenizer = open_tokenizer(hf_tokenizer_dir)
    assert manifest["tokenizer"]["file"] == "tokenizer/tokenizer.json"
    assert manifest["tokenizer"]["vocab_size"] == tokenizer.vocab_size
    total = sum(len(tokenizer.encode(t)) for t in texts)
    assert sum(manifest["tokens_written"].values()) == total
    cfg = DataConfig(source=str(out), seq_len=256, global_batch_size=2, streams=1,
                     prefetch_batches=1)
    loaded = load_tokenizer(cfg, tokenizer.vocab_size)  # from the prepared folder
    assert isinstance(loaded, HFTokenizer) and loaded.chat_template == CHATML_TEMPLATE
    batch = next(iter(make_dataset(cfg, loaded)))
    first = batch["tokens"][0][: list(batch["tokens"][0]).index(tokenizer.eos_id)]
    assert tokenizer.decode(first) in texts
