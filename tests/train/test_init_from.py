"""train.init_from: the weights of an HF directory, a converted directory or a run checkpoint
(on another mesh, in the other layer layout) arrive exactly; the first step's loss is the HF
model's; architecture mismatches are one-line errors; mtp_depth=0 drops MTP weights with a
warning; a run's own checkpoints win over init_from."""

import json

import grain
import jax
import numpy as np
import pytest
from flax import nnx

from maxmoe.cli import main
from maxmoe.config import CheckpointConfig, ConfigError
from maxmoe.config_files import load_config, save_config, to_dict
from maxmoe.convert.from_hf import convert_from_hf, read_hf
from maxmoe.sharding import global_batch, make_mesh, use_mesh
from maxmoe.train import evaluate, loop, setup
from maxmoe.train.checkpoint import Checkpointer
from maxmoe.train.init_from import initial_state, open_init_source
from maxmoe.train.setup import prepare_run
from maxmoe.validation import validate
from tests.convert.test_convert import (
    DEEPSEEK,
    FIXTURES,
    make_hub_checkpoint_with_mtp_fp8_and_shards,
)
from tests.helpers import per_layer
from tests.train.test_precision import learnable_batch

EXACT = ["precision.compute_dtype=float32", "model.remat_policy=none", "data.seq_len=11",
         "data.global_batch_size=8", "checkpoint.async_save=false"]


def run_config(model_yaml, *overrides):
    """A run of the converted model's architecture (its config.yaml) with test settings."""
    return load_config([str(model_yaml)], EXACT + list(overrides))


def start(cfg_origins, devices: int = 8, messages: list | None = None):
    """(setup, state) of a run that starts from cfg.train.init_from on `devices` devices."""
    cfg, origins = cfg_origins
    run = prepare_run(cfg, validate(cfg, devices, origins), devices=jax.devices()[:devices])
    messages = [] if messages is None else messages
    source = open_init_source(cfg)
    messages += source.warnings
    return run, initial_state(run.trainer, cfg, source, messages.append)


def weights(state) -> dict:
    """params and buffers as one pure dict of numpy arrays (read_hf's layout)."""
    merged = jax.tree.map(np.asarray, state["params"])
    for g, group in state.get("buffers", {}).get("layer_groups", {}).items():
        for path, x in jax.tree_util.tree_flatten_with_path(group)[0]:
            node = merged["layer_groups"][g]
            keys = [getattr(k, "key", k) for k in path]
            for k in keys[:-1]:
                node = node[k]
            node[keys[-1]] = np.asarray(x)
    return merged


def assert_same(got: dict, want: dict):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def first_loss(run, state, batch) -> dict:
    """The first step's loss metrics: the model's loss on the state's params and buffers (what
    the train step reports before it updates them), on the run's mesh, without compiling the
    backward pass and optimizer."""
    trainer = run.trainer

    @jax.jit
    def loss(params, buffers, batch):
        total, metrics = nnx.merge(trainer.graphdef, params, *buffers).loss(batch)
        return dict(metrics, loss=total)

    with use_mesh(trainer.mesh, trainer.rules):
        metrics = loss(state["params"], [state["buffers"]] if "buffers" in state else [],
                       global_batch(batch, trainer.batch_sharding))
    return {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "deepseek"
    convert_from_hf(DEEPSEEK, out)
    return out


def test_hf_and_converted_give_the_hf_models_params_and_loss(converted):
    """DeepSeek-V3 fixture (MLA, sigmoid router with its bias buffer, yarn): read straight from
    safetensors and from `convert from-hf` the weights equal read_hf's bit for bit, the first
    step's losses are equal, and its cross-entropy is that of the HF logits (1e-4, the
    conversion tests' tolerance; reference: tests/fixtures/hf/*/logits.npy)."""
    _, want, _, _ = read_hf(DEEPSEEK)
    ids = np.load(DEEPSEEK / "input_ids.npy")  # [2, 12]
    batch = dict(tokens=ids[:, :-1], targets=ids[:, 1:], segment_ids=np.ones_like(ids[:, 1:]),
                 positions=np.broadcast_to(np.arange(11, dtype=np.int32), (2, 11)).copy(),
                 loss_mask=np.ones(ids[:, 1:].shape, np.float32))
    no_aux = ["data.global_batch_size=2", "moe.aux_loss_weight=0", "moe.z_loss_weight=0",
              "moe.sequence_balance_loss_weight=0"]
    losses, messages = [], []
    for source in (DEEPSEEK, converted):
        run, state = start(run_config(converted / "config.yaml", f"train.init_from={source}",
                                      *no_aux), devices=2, messages=messages)
        assert "buffers" in state and state["step"] == 0
        assert_same(weights(state), want)
        losses.append(first_loss(run, state, batch)["ce_loss"])
    assert losses[0] == losses[1]
    logits = np.load(DEEPSEEK / "logits.npy")[:, :-1].astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    hf_ce = -np.take_along_axis(logp, ids[:, 1:, None], -1).mean()
    assert abs(losses[0] - hf_ce) < 1e-4
    assert "Hugging Face checkpoint" in messages[0] and "optimizer, step and data start fresh" \
        in messages[0] and "converted checkpoint" in messages[1]


def save_run(run_dir, run, state, step: int):
    run_dir.mkdir()
    save_config(run.cfg, run_dir / "config.yaml")
    with Checkpointer(run_dir / "checkpoints", CheckpointConfig(async_save=False)) as ckpt:
        assert ckpt.save(step, state, force=True, config=to_dict(run.cfg))


def test_run_checkpoint_on_another_mesh_and_layer_layout(tmp_path, converted):
    """A run saved on data=8 (stacked layers, params and router bias moved off the HF values)
    starts runs on fsdp=4 x data=2 per-layer, and that one's checkpoint a stacked fsdp run:
    every param and bias arrives exactly, placed as the new mesh shards it. The HF directory
    read onto the fsdp mesh per-layer gives read_hf's values too."""
    run_a, state = start(run_config(converted / "config.yaml", f"train.init_from={converted}"))
    state = dict(state, params=jax.tree.map(lambda x: x * 1.5 + 0.25, state["params"]),
                 buffers=jax.tree.map(lambda x: x + 0.5, state["buffers"]))
    want = weights(state)
    save_run(tmp_path / "a", run_a, state, 3)

    fsdp = ["mesh.fsdp=4", "mesh.data=2"]
    run_b, state_b = start(run_config(converted / "config.yaml", f"train.init_from={tmp_path / 'a'}",
                                      "model.scan_layers=false", *fsdp))
    assert_same(weights(state_b), per_layer(want))
    embed = state_b["params"]["embed"]["embedding"]
    assert embed.sharding == run_b.trainer.abstract_state["params"]["embed"]["embedding"].sharding
    assert "fsdp" in str(embed.sharding.spec)
    save_run(tmp_path / "b", run_b, state_b, 5)

    _, state_c = start(run_config(converted / "config.yaml",
                                  f"train.init_from={tmp_path / 'b' / 'checkpoints' / '5'}", *fsdp))
    assert_same(weights(state_c), want)
    # HF safetensors read shard by shard (fsdp splits the leaves; data replicas share reads)
    _, per_layer_hf = start(run_config(converted / "config.yaml", f"train.init_from={DEEPSEEK}",
                                       "model.scan_layers=false", *fsdp))
    assert_same(weights(per_layer_hf), per_layer(read_hf(DEEPSEEK)[1]))


def test_architecture_mismatch_is_one_line_before_anything_runs(tmp_path, converted, capsys):
    for override, field in [("model.hidden_size=32", "model.hidden_size"),
                            ("attention.kv_lora_rank=16", "attention.kv_lora_rank"),
                            ("moe.router=softmax", "moe.router")]:
        cfg, _ = run_config(converted / "config.yaml", f"train.init_from={DEEPSEEK}", override)
        with pytest.raises(ConfigError) as e:
            open_init_source(cfg)
        assert len(str(e.value).splitlines()) == 1
        assert str(e.value).startswith(f"config key '{field}'") and "set " + field in str(e.value)
    for dry_run in ([], ["--dry-run"]):
        code = main(["train", str(converted / "config.yaml"), *EXACT, *dry_run,
                     f"run.dir={tmp_path / 'run'}", f"train.init_from={converted}",
                     "moe.num_experts=32"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "moe.num_experts" in err[0]
        assert not (tmp_path / "run").exists()  # failed before the run dir was made
    with pytest.raises(ConfigError, match="no such directory"):
        open_init_source(run_config(converted / "config.yaml",
                                    f"train.init_from={tmp_path / 'nowhere'}")[0])


def test_mtp_depth_zero_drops_the_checkpoints_mtp_weights(tmp_path):
    """A DeepSeek-V3 hub checkpoint with an MTP layer (two shards, one FP8 weight), read
    directly or converted: a run with mtp_depth=0 loads everything else, with one warning;
    mtp_depth=2 is a mismatch."""
    make_hub_checkpoint_with_mtp_fp8_and_shards(DEEPSEEK, tmp_path / "hub")
    convert_from_hf(tmp_path / "hub", tmp_path / "conv")
    _, want, _, _ = read_hf(tmp_path / "hub")
    del want["mtp"]
    for source in (tmp_path / "hub", tmp_path / "conv"):
        messages = []
        _, state = start(run_config(tmp_path / "conv" / "config.yaml", "model.mtp_depth=0",
                                    f"train.init_from={source}"), messages=messages)
        assert_same(weights(state), want)
        assert messages[0] == ("warning: train.init_from: model.mtp_depth=0 drops the "
                               "checkpoint's 1 MTP depth(s) (their weights are not loaded)")
    cfg, _ = run_config(tmp_path / "conv" / "config.yaml", "model.mtp_depth=2",
                        f"train.init_from={tmp_path / 'hub'}")
    with pytest.raises(ConfigError, match="model.mtp_depth"):
        open_init_source(cfg)


class _Tokenizer:
    vocab_size, path = 64, "fake"

    def save(self, directory):  # the loop saves the run's tokenizer; nothing to write here
        pass


def _train(tmp_path, monkeypatch, cfg_origins):
    cfg, origins = cfg_origins
    monkeypatch.setattr(evaluate, "load_tokenizer", lambda *a, **k: _Tokenizer())
    monkeypatch.setattr(loop, "make_dataset", lambda *a, **k: grain.MapDataset.range(100).map(
        lambda i: learnable_batch(cfg, int(i))).to_iter_dataset())
    monkeypatch.setattr(setup, "make_mesh", lambda sizes, **_: make_mesh(sizes, jax.devices()[:1]))
    return loop.train(cfg, validate(cfg, 1, origins))


@pytest.mark.slow
def test_loop_starts_from_hf_then_its_own_checkpoints_win(tmp_path, monkeypatch, capsys):
    """The real loop (Mixtral fixture, one device): step 1's loss is the loss of the converted
    model on the same batch; run again with more steps, it resumes from its own step 2 and
    says that init_from is not read."""
    hub = FIXTURES / "mixtral"
    convert_from_hf(hub, tmp_path / "conv")
    settings = ["data.global_batch_size=2", "train.steps=2", "checkpoint.every_steps=2",
                "logging.every_steps=1", "logging.progress_bar=false", "logging.tensorboard=false",
                f"run.dir={tmp_path / 'run'}", "mesh.data=1"]
    cfg_origins = run_config(tmp_path / "conv" / "config.yaml", f"train.init_from={hub}",
                             *settings)
    summary = _train(tmp_path, monkeypatch, cfg_origins)
    err = capsys.readouterr().err
    assert f"train.init_from: params from Hugging Face checkpoint {hub}" in err
    reference = run_config(tmp_path / "conv" / "config.yaml",
                           f"train.init_from={tmp_path / 'conv'}", *settings)
    run, state = start(reference, devices=1)
    want = first_loss(run, state, learnable_batch(run.cfg, 0))["loss"]
    np.testing.assert_allclose(summary["first_loss"], want, rtol=1e-6)

    more = run_config(tmp_path / "conv" / "config.yaml", f"train.init_from={hub}", *settings,
                      "train.steps=3")
    summary = _train(tmp_path, monkeypatch, more)
    err = capsys.readouterr().err
    assert summary["start_step"] == 2 and summary["final_step"] == 3
    assert f"train.init_from={hub} not read: the run's own checkpoints win" in err
    assert "Hugging Face checkpoint" not in err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2, 3]
