"""Bad input, counted: each case below is a distinct mistake a user makes with configs, data,
checkpoints, Hugging Face directories or the command line, caught by its own check (BAD's
third column names it). Property, for every case: `maxmoe ...` exits 2 with exactly one line
on stderr, `maxmoe: error: ...` naming what is wrong (the expected words), no traceback, and
every file and folder of the workspace (a trained run, Hugging Face directories, data, config
files) is byte-identical afterwards, with nothing created beside them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from maxmoe.cli import main
from tests.helpers import SMALL

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hf"
RUN = [*SMALL, "model.vocab_size=512", "train.steps=1", "checkpoint.every_steps=1",
       "logging.progress_bar=false", "run.dir={w}/run"]
TRAIN = ["train", *RUN]

# name: (argv, words the one line contains, the check that catches it); {w} = the workspace
BAD = {
    # configs
    "unknown_key": ([*TRAIN, "model.hidden_sise=4"], "'model.hidden_sise'",
                    "config._merge: unknown key"),
    "wrong_type": ([*TRAIN, "train.steps=many"], "expected int, got str", "config: field types"),
    "missing_file": (["train", "{w}/nope.yaml"], "not found", "config.load_config: file exists"),
    "yaml_syntax": (["train", "{w}/broken.yaml"], "broken.yaml", "config: YAML parse error"),
    "yaml_not_mapping": (["train", "{w}/list.yaml"], "list.yaml",
                         "config: top level must be a mapping"),
    "override_without_value": ([*TRAIN, "train.steps"], "train.steps",
                               "config: KEY=VALUE form"),
    "topk_over_experts": ([*TRAIN, "moe.experts_per_token=9"], "moe.experts_per_token",
                          "validation: top-k <= experts"),
    "kv_heads": ([*TRAIN, "attention.num_kv_heads=3"], "attention.num_kv_heads",
                 "validation: kv heads divide heads"),
    "mesh_product": ([*TRAIN, "mesh.data=4", "mesh.fsdp=4"], "mesh.data",
                     "validation.resolve_mesh_shape: product == devices"),
    "mesh_fill": ([*TRAIN, "mesh.expert=3"], "mesh.expert",
                  "validation.resolve_mesh_shape: -1 fill divides"),
    "mesh_two_fills": ([*TRAIN, "mesh.fsdp=-1"], "only one mesh axis may be -1",
                       "validation.resolve_mesh_shape: one -1 axis"),
    "mesh_zero": ([*TRAIN, "mesh.tensor=0"], "mesh.tensor",
                  "validation.resolve_mesh_shape: sizes >= 1"),
    "drop_policy": ([*TRAIN, "moe.drop_policy=random"], "moe.drop_policy",
                    "validation: known drop policy"),
    "loss_chunk": ([*TRAIN, "model.lm_loss_chunk=7"], "model.lm_loss_chunk",
                   "validation.check_loss_chunk"),
    "compute_dtype": ([*TRAIN, "precision.compute_dtype=float8"], "precision.compute_dtype",
                      "validation: known compute dtype"),
    "wandb_mode": ([*TRAIN, "logging.wandb_project=p", "logging.wandb_mode=sometimes"],
                   "logging.wandb_mode", "metrics.wandb_writer.check_wandb"),
    "side_work_bound": ([*TRAIN, "logging.side_work_timeout_s=900"],
                        "logging.side_work_timeout_s", "validation.check_side_work_bound"),
    "cluster_spec": ([*TRAIN, "--cluster", "12xbogus"], "bogus", "plan.live.live_cluster"),
    # data
    "no_such_source": ([*TRAIN, "data.source={w}/no_such_corpus/*.txt"], "data.source",
                       "data: source has documents"),
    "validation_fraction": ([*TRAIN, "data.validation_fraction=1.5"],
                            "data.validation_fraction", "data.corpus.split_documents"),
    "no_tokenizer_dir": ([*TRAIN, "data.tokenizer_dir={w}/no_tokenizer"], "data.tokenizer_dir",
                         "data.tokenizer: tokenizer folder exists"),
    "tokenizer_too_big": ([*TRAIN, "model.vocab_size=256", "data.tokenizer_dir={w}/hf_tok",
                           "run.dir={w}/other"], "model.vocab_size",
                          "train.evaluate.model_tokenizer: vocab fits"),
    "sft_bad_json": ([*TRAIN, "data.format=sft", "data.source={w}/bad.jsonl",
                      "data.tokenizer_dir={w}/hf_tok", "run.dir={w}/other"], "bad.jsonl",
                     "data.sft: records parse"),
    # checkpoints
    "refused_layout": ([*TRAIN, "model.vocab_size=1024"], "saved for another model layout",
                       "train.saved_steps.check_resumable"),
    "init_from_missing": ([*TRAIN, "run.dir={w}/other", "train.init_from={w}/no_run"],
                          "train.init_from", "train.init_from.open_init_source: exists"),
    "init_from_layout": ([*TRAIN, "run.dir={w}/other", "train.init_from={w}/run",
                          "model.num_layers=4"], "train.init_from",
                         "train.init_from: architecture matches"),
    "eval_no_checkpoint": (["eval", "{w}/empty"], "holds no committed checkpoint",
                           "train.evaluate.find_checkpoint: committed step"),
    "eval_no_dir": (["eval", "{w}/no_run"], "no such directory",
                    "train.evaluate.find_checkpoint: directory"),
    "verify_no_checkpoint": (["ckpt", "verify", "{w}/empty"], "no checkpoint here",
                             "train.checksums.items_under: a checkpoint"),
    "eval_extra_path": (["eval", "{w}/run", "{w}/run"], "KEY=VALUE overrides only",
                        "commands.eval.run: arguments"),
    "eval_empty_split": (["eval", "{w}/run", "--data", "{w}/empty/*.txt"], "data.source",
                         "eval: split has documents"),
    # Hugging Face directories
    "hf_no_config": (["convert", "from-hf", "{w}/hf_noconfig", "{w}/out"], "config.json",
                     "convert.hf_config: config.json exists"),
    "hf_model_type": (["convert", "from-hf", "{w}/hf_gpt2", "{w}/out"], "gpt2",
                      "convert.hf_config: supported model_type"),
    "to_hf_not_checkpoint": (["convert", "to-hf", "{w}/empty", "{w}/out"], "empty",
                             "convert.checkpoint_io: a checkpoint"),
    # command line
    "bench_steps": (["bench", "configs/tiny.yaml", "--steps", "0"], "--steps",
                    "commands.bench.positive_int"),
    "bench_sweep_form": (["bench", "configs/tiny.yaml", "--sweep", "moe.dispatch"],
                         "--sweep expects KEY=V1,V2", "commands.bench: sweep form"),
    "generate_no_prompt": (["generate", "{w}/run"], "prompt", "commands.generate: a prompt"),
    "forward_bad_input": (["forward", "{w}/run", "--input", "{w}/nope.npy", "--output",
                           "{w}/logits.npy"], "nope.npy", "commands.forward: input exists"),
}


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root but the tokenizer cache: relative -> md5 (file) or 'dir'."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.md5(p.read_bytes())
            .hexdigest() for p in sorted(root.rglob("*")) if "cache" not in p.parts}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A trained run, Hugging Face directories (good, no config.json, unsupported type), a
    Hugging Face tokenizer, an empty folder, broken config and data files."""
    from tests.data.conftest import write_hf_tokenizer

    w = tmp_path_factory.mktemp("bad_inputs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MAXMOE_CACHE", str(w / "cache"))
        assert main([a.format(w=w) for a in TRAIN]) == 0
    write_hf_tokenizer(w / "hf_tok", vocab_size=400)
    (w / "empty").mkdir()
    (w / "broken.yaml").write_text("model: {hidden_size: 64\n")
    (w / "list.yaml").write_text("- model\n- train\n")
    (w / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}\n')
    shutil.copytree(FIXTURES / "mixtral", w / "hf_noconfig")
    (w / "hf_noconfig" / "config.json").unlink()
    shutil.copytree(FIXTURES / "mixtral", w / "hf_gpt2")
    config = json.loads((w / "hf_gpt2" / "config.json").read_text())
    (w / "hf_gpt2" / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    return w


def test_at_least_30_distinct_checks():
    assert len(BAD) >= 30
    assert len({check for _, _, check in BAD.values()}) == len(BAD)


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_one_line_exit_2_and_changes_nothing(name, workspace, monkeypatch, capsys):
    argv, words, _ = BAD[name]
    monkeypatch.setenv("MAXMOE_CACHE", str(workspace / "cache"))
    before = snapshot(workspace)
    capsys.readouterr()
    code = main([a.format(w=workspace) for a in argv])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, captured.err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("maxmoe: error: "), lines[-10:]
    assert words in lines[0], lines[0]
    assert snapshot(workspace) == before
