"""`maxmoe generate` on the command line: ids in, ids out (HF's greedy tokens), ragged prompts,
tokens/s printed; bad input is one line with exit code 2, before any model is loaded."""

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from maxmoe.cli import main
from maxmoe.convert.from_hf import convert_from_hf

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
NAME = "qwen3_moe_mlp_only_yarn"  # max_position_embeddings 256


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "ckpt"
    convert_from_hf(FIXTURES / NAME, out)
    return out


def word_tokenizer(directory: Path, words: int) -> Path:
    """A Hugging Face word-level tokenizer folder: <pad> 0, </s> 1, then w2.. w<words-1>."""
    vocab = {"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "pad_token": "<pad>"}))
    return directory


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("argv, says", [
    ([], "no prompt given"),
    (["--input", "missing.npy"], "--input 'missing.npy': not found"),
    (["--prompt", "hello"], "text prompts need a tokenizer"),
    (["--input", "LONG"], "longer than the model's 256 positions"),
    (["--input", "IDS", "--max-new-tokens", "250"], "lower --max-new-tokens to 244"),
    (["--input", "IDS", "--mesh", "pipeline=2"], "decoding runs no pipeline"),
    (["--input", "IDS", "--temperature", "-1"], "need temperature >= 0"),
    (["--prompt", "w3", "--tokenizer", "BIG"], "model.vocab_size"),
    (["--prompt", "w3", "--tokenizer", "WORDS", "--add-bos"], "has no BOS token"),
])
def test_bad_input_is_one_line_and_exit_2(ckpt, tmp_path, capsys, argv, says):
    np.save(tmp_path / "long.npy", np.ones((1, 300), np.int32))
    paths = {"LONG": str(tmp_path / "long.npy"), "IDS": str(FIXTURES / NAME / "input_ids.npy"),
             "BIG": str(word_tokenizer(tmp_path / "big", 100)),
             "WORDS": str(word_tokenizer(tmp_path / "words", 64))}
    assert main(["generate", str(ckpt), *[paths.get(a, a) for a in argv]]) == 2
    assert says in one_error_line(capsys)


def test_unknown_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "nowhere"), "--input", "x.npy"]) == 2
    assert "not found" in one_error_line(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["generate", str(tmp_path / "empty"), "--input", "x.npy"]) == 2
    assert "no config.yaml" in one_error_line(capsys)


@pytest.mark.slow
def test_generate_writes_hf_greedy_ids_for_ragged_prompts(ckpt, tmp_path, capsys):
    """An .npz of a 12-token and a 4-token prompt, left-padded with --pad-id: the full prompt
    gets HF's greedy tokens (generate.npy); the output is int32 [2, 12 + 8]."""
    ids = np.load(FIXTURES / NAME / "input_ids.npy")
    np.savez(tmp_path / "ragged.npz", ids[0], ids[1, -4:])
    out = tmp_path / "out.npy"
    assert main(["generate", str(ckpt), "--input", str(tmp_path / "ragged.npz"), "--pad-id",
                 "5", "--max-new-tokens", "8", "--output", str(out)]) == 0
    got = np.load(out)
    assert got.dtype == np.int32 and got.shape == (2, 20)
    np.testing.assert_array_equal(got[0], np.load(FIXTURES / NAME / "generate.npy")[0])
    np.testing.assert_array_equal(got[1, :12], [5] * 8 + ids[1, -4:].tolist())
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == " ".join(map(str, got[0, 12:]))
    assert "tokens/s" in captured.err and "decode 8 steps x 2 rows" in captured.err


@pytest.mark.slow
def test_text_prompts_through_the_tokenizer(ckpt, tmp_path, capsys):
    """--prompt texts are encoded with --tokenizer, left-padded with its pad id; the new ids
    are printed decoded; EOS is the tokenizer's (a row after it holds pad ids)."""
    tokenizer = word_tokenizer(tmp_path / "words", 64)
    out = tmp_path / "out.npy"
    assert main(["generate", str(ckpt), "--tokenizer", str(tokenizer), "--prompt",
                 "w5 w9 w17 w33", "--prompt", "w40 w2", "--max-new-tokens", "6",
                 "--output", str(out)]) == 0
    got = np.load(out)
    assert got.shape == (2, 10)
    assert got[:, :4].tolist() == [[5, 9, 17, 33], [0, 0, 40, 2]]
    lines = capsys.readouterr().out.splitlines()
    for row, line in zip(got[:, 4:], lines, strict=True):
        ended = np.flatnonzero(row == 1)
        if ended.size:  # EOS kept, pad (0) after it; decode drops neither kind of id's text
            assert (row[ended[0] + 1:] == 0).all()
        assert line.split() == [f"w{t}" for t in row if t > 1]
