"""Fine-tuning data (data.format=sft): the loss mask covers exactly the answer tokens, checked
token by token against text written out by hand (not rendered by the code under test); packing
keeps records apart; bad records are one-line errors naming the file and line."""

import dataclasses
import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizerModel

from maxmoe.config import ConfigError, DataConfig
from maxmoe.data import sft
from maxmoe.data.chat import conversation_ids
from maxmoe.data.pipeline import make_dataset
from maxmoe.data.tokenizer import open_tokenizer
from tests.data.conftest import english, write_hf_tokenizer

CONVERSATION = [
    {"role": "system", "content": "you are here"},
    {"role": "user", "content": "what is the water"},
    {"role": "assistant", "content": "the water is long"},
    {"role": "user", "content": "and then"},
    {"role": "assistant", "content": "then we go"},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_chat_template_mask_token_by_token(hf_tokenizer_dir):
    tokenizer = open_tokenizer(hf_tokenizer_dir)
    reference = HFTokenizerModel.from_file(str(hf_tokenizer_dir / "tokenizer.json"))
    messages, trained = sft.conversation({"messages": CONVERSATION}, "x:1")
    ids, flags = conversation_ids(tokenizer, messages, trained)
    # the ChatML text, written out by hand: (text, trained)
    pieces = [("<s><|im_start|>system\nyou are here<|im_end|>\n<|im_start|>user\nwhat is the "
               "water<|im_end|>\n<|im_start|>assistant\n", False),
              ("the water is long<|im_end|>\n", True),
              ("<|im_start|>user\nand then<|im_end|>\n<|im_start|>assistant\n", False),
              ("then we go<|im_end|>\n", True)]
    expected = [(i, flag) for text, flag in pieces
                for i in reference.encode(text, add_special_tokens=False).ids]
    assert list(zip(ids, flags, strict=True)) == expected
    # the same ids as the whole conversation tokenised in one go
    assert ids == reference.encode("".join(t for t, _ in pieces), add_special_tokens=False).ids
    features = sft.document_features(ids, flags)
    trained_targets = features["targets"][features["loss_mask"] > 0]
    assert reference.decode(trained_targets.tolist(), skip_special_tokens=False) == (
        "the water is long<|im_end|>\nthen we go<|im_end|>\n")
    assert features["loss_mask"][-1] == 0 and features["targets"][-1] == 0


def test_default_format_and_prompt_completion(tokenizer, hf_tokenizer_dir):
    """SentencePiece (no template): the documented default format, EOS id ending each answer;
    a prompt/completion pair is a user turn and an assistant turn."""
    messages, trained = sft.conversation({"prompt": "what is it", "completion": "it is"}, "x:1")
    assert trained == [False, True]
    ids, flags = conversation_ids(tokenizer, messages, trained)
    head = tokenizer.encode("<|user|>\nwhat is it\n") + tokenizer.encode("<|assistant|>\n")
    answer = tokenizer.encode("it is") + [tokenizer.eos_id]
    assert ids == head + answer and flags == [False] * len(head) + [True] * len(answer)
    # a list-of-messages prompt/completion: only the completion's assistant turns train
    messages, trained = sft.conversation({"prompt": CONVERSATION[:3],
                                          "completion": CONVERSATION[3:]}, "x:1")
    assert trained == [False, False, False, False, True]


def test_sft_batches_mask_only_answers_and_keep_records_apart(hf_tokenizer_dir, tmp_path):
    tokenizer = open_tokenizer(hf_tokenizer_dir)
    rng = random.Random(3)
    answers = [f"answer {i} " + english(rng, 3) for i in range(40)]
    write_jsonl(tmp_path / "a.jsonl", [
        {"messages": [{"role": "user", "content": english(rng, 8)},
                      {"role": "assistant", "content": a}]} for a in answers[:20]])
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": english(rng, 8), "completion": a}
                                       for a in answers[20:]])
    cfg = DataConfig(source=str(tmp_path / "*.jsonl"), format="sft", seq_len=48,
                     global_batch_size=4, streams=1, prefetch_batches=1, validation_fraction=0.1,
                     tokenizer_dir=str(hf_tokenizer_dir))
    batches = [b for _, b in zip(range(6), make_dataset(cfg, tokenizer), strict=False)]
    end = tokenizer.encode("<|im_end|>")[0]
    for batch in batches:
        mask, segments = batch["loss_mask"] > 0, batch["segment_ids"]
        # a trained target never crosses into the next record of the row
        same = np.concatenate([segments[:, 1:] == segments[:, :-1],
                               np.ones((len(segments), 1), bool)], axis=1)
        assert not (mask & ~same).any() and not (mask & (segments == 0)).any()
        for row in range(len(mask)):
            text = tokenizer._tokenizer.decode(batch["targets"][row][mask[row]].tolist(),
                                               skip_special_tokens=False)
            # answers (whole or cut at the row's edges) and their end-of-turn, nothing else
            for part in text.split("<|im_end|>\n"):
                assert not part or any(part in a or a in part for a in answers), part
            assert "user" not in text
        assert (batch["targets"][mask] == end).any() or not mask.any()
    validation = list(make_dataset(cfg, tokenizer, split="validation", num_epochs=1))
    assert validation and all(b["loss_mask"].sum() > 0 for b in validation[:1])


def test_bad_records_name_file_and_line(hf_tokenizer_dir, tmp_path, capsys):
    tokenizer = open_tokenizer(hf_tokenizer_dir)
    good = {"prompt": "a", "completion": "b"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, {"text": "no chat here"}])
    cfg = DataConfig(source=str(path), format="sft", tokenizer_dir=str(hf_tokenizer_dir),
                     streams=1)
    with pytest.raises(ConfigError, match=f"{path}:3: the record has neither 'messages'") as e:
        make_dataset(cfg, tokenizer)
    assert "\n" not in str(e.value)
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(ConfigError, match=f"{path}:2: not a JSON line"):
        make_dataset(cfg, tokenizer)
    # records without an answer are skipped and counted; a file of only such records fails
    no_answer = {"messages": [{"role": "user", "content": "hi"}]}
    write_jsonl(path, [good, no_answer, good, good])
    make_dataset(dataclasses.replace(cfg, validation_fraction=0.0), tokenizer)
    err = capsys.readouterr().err
    assert err.count("skipped 1 of 4 records without an assistant turn") == 1, err
    write_jsonl(path, [no_answer, no_answer])
    with pytest.raises(ConfigError, match="none of its 2 records has an assistant turn"):
        make_dataset(cfg, tokenizer)


def test_template_that_cannot_mark_answers_is_refused(tmp_path):
    # renders the conversation newest first, so a prefix is not the start of the whole
    reverse = write_hf_tokenizer(tmp_path / "tok", chat_template=(
        "{% for m in messages | reverse %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
        "{% endfor %}"), config={"eos_token": "</s>"})
    tokenizer = open_tokenizer(reverse)
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a b", "completion": "c d"}])
    cfg = DataConfig(source=str(path), format="sft", validation_fraction=0.0, streams=1)
    with pytest.raises(ConfigError, match=f"{path}:1: the chat template does not render"):
        make_dataset(cfg, tokenizer)
