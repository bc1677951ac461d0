"""`maxmoe data tokenizer|prepare` from the command line: results, reports, one-line errors."""

import json
import random

import pytest

from maxmoe.cli import main
from maxmoe.config import ConfigError
from maxmoe.config_files import load_config
from maxmoe.validation import validate

from .conftest import english


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(8)
    root = tmp_path_factory.mktemp("cli_corpus")
    (root / "docs.jsonl").write_text("".join(
        json.dumps({"content": f"doc {i} " + english(rng, 60)}) + "\n" for i in range(150)))
    (root / "bad.jsonl").write_bytes(b'{"content": "ok but short"}\n{broken\n')
    return root


def test_tokenizer_then_prepare(corpus, tmp_path, capsys):
    """`data tokenizer` then `data prepare` over 2 JSONL files: the reports count what was read,
    dropped and skipped (malformed line named by file and line); the manifest lists 150
    documents and one shard set per task that kept any; rerunning finds every task done and
    changes nothing; other settings into the same folder are one line, exit 2, the shards left
    alone."""
    tokenizer = tmp_path / "tokenizer"
    assert main(["data", "tokenizer", str(corpus), "--vocab-size", "300", "--out",
                 str(tokenizer), "--json-field", "content"]) == 0
    assert (tokenizer / "tokenizer.model").is_file()
    assert "trained a 300-piece bpe tokenizer" in capsys.readouterr().out
    out = tmp_path / "prepared"
    assert main(["data", "prepare", str(corpus), "--tokenizer", str(tokenizer), "--out",
                 str(out), "--json-field", "content", "--min-characters", "20",
                 "--workers", "1", "--tasks", "3"]) == 0
    captured = capsys.readouterr()
    assert "151 documents read from 2 files" in captured.out
    assert "dropped 1 too few characters" in captured.out
    assert "skipped 1 malformed json" in captured.err and "bad.jsonl:2" in captured.err
    manifest = json.loads((out / "manifest.json").read_text())
    assert sum(manifest["documents_written"].values()) == 150
    # 2 files, 3 tasks: task 0 reads bad.jsonl (nothing survives), task 1 docs.jsonl, task 2
    # nothing; a task without survivors writes no shard file
    assert [sorted(s["files"]) for s in manifest["shards"]] == [[], ["train", "validation"], []]
    # the same command again finds every task finished
    assert main(["data", "prepare", str(corpus), "--tokenizer", str(tokenizer), "--out",
                 str(out), "--json-field", "content", "--min-characters", "20",
                 "--workers", "1", "--tasks", "3"]) == 0
    assert json.loads((out / "manifest.json").read_text()) == manifest
    # another run's settings into the same folder: one line, exit 2, the shards left alone
    capsys.readouterr()
    assert main(["data", "prepare", str(corpus), "--tokenizer", str(tokenizer), "--out",
                 str(out), "--json-field", "content", "--seed", "1"]) == 2
    error = capsys.readouterr().err.strip()
    assert "holds the shards of another prepare run" in error and len(error.splitlines()) == 1
    assert json.loads((out / "manifest.json").read_text()) == manifest


@pytest.mark.parametrize("arguments, message", [
    (["prepare", "{corpus}", "--tokenizer", "{tmp}/none", "--out", "{tmp}/o"], "--tokenizer"),
    (["prepare", "{tmp}/missing/*.jsonl", "--tokenizer", "{tmp}", "--out", "{tmp}/o"],
     "matches no files"),
    (["prepare", "{corpus}", "--tokenizer", "{tokenizer}", "--out", "{tmp}/o", "--tasks", "0"],
     "--tasks"),
    (["prepare", "{corpus}", "--tokenizer", "{tokenizer}", "--out", "{tmp}/o", "--decontaminate",
      "{tmp}/no-such-eval.jsonl"], "--decontaminate"),
    (["prepare", "{corpus}", "--tokenizer", "{tokenizer}", "--out", "{tmp}/o", "--executor",
      "slurm"], "--partition"),
    (["prepare", "{corpus}", "--tokenizer", "{tokenizer}", "--out", "{tmp}/o", "--dry-run"],
     "--dry-run"),
    (["prepare", "{corpus}", "--tokenizer", "{tokenizer}", "--out", "{tmp}/o", "--executor",
      "ray", "--ray-address", "127.0.0.1:1"], "no Ray cluster answers there"),
    (["prepare", "{corpus}", "--tokenizer", "{tokenizer}", "--out", "{tmp}/o",
      "--languages", "en,xx"], "--languages"),
    (["prepare", "{corpus}", "--tokenizer", "{tokenizer}", "--out", "{corpus}"],
     "not empty and not a prepare run"),
    (["tokenizer", "{corpus}", "--vocab-size", "5", "--out", "{tmp}/t"], "--vocab-size"),
])
def test_user_errors_are_one_line_with_exit_code_2(corpus, tokenizer_dir, tmp_path, capsys,
                                                   arguments, message):
    values = {"corpus": str(corpus), "tmp": str(tmp_path), "tokenizer": str(tokenizer_dir)}
    assert main(["data"] + [a.format(**values) for a in arguments]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("maxmoe: error:") and message in error
    assert "Traceback" not in error and len(error.splitlines()) == 1


def test_data_without_command_prints_help(capsys):
    assert main(["data"]) == 2
    assert "maxmoe data tokenizer" in capsys.readouterr().out


def test_mixture_setting_is_validated():
    cfg, origins = load_config([], ["data.mixture=a:0.5,b"])
    with pytest.raises(ConfigError, match="data.mixture"):
        validate(cfg, 1, origins)
    cfg, origins = load_config([], ["data.mixture=a:3, b:1"])
    assert cfg.data.mixture_weights() == {"a": 0.75, "b": 0.25}
