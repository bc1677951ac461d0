"""Per-layer metrics (docs/observability.md, Metrics): the step's arrays have the documented shapes
and
agree between stacked and unrolled layers; the real loop writes them to metrics.jsonl; a
router that starves experts is caught (guard.router_action warn and stop)."""

import json

import jax
import numpy as np
import pytest

from maxmoe.model import moe
from maxmoe.model.router import RouterBias
from maxmoe.sharding import global_batch, make_mesh
from maxmoe.train import evaluate, loop, setup
from maxmoe.train.guards import TrainingStopped
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate
from tests.helpers import random_batch, small_config
from tests.train.test_guards import _fake_data, _Tokenizer

# small_config has layer 0 dense and layers 1-2 MoE (8 experts, one shared)
PER_LAYER = ("router_entropy", "dropped_fraction_by_layer", "activation_rms_by_layer",
             "update_ratio_by_layer", "expert_load")


def one_step(*overrides):
    cfg, origins = small_config("model.remat_policy=none", "logging.every_steps=1", *overrides)
    trainer = make_trainer(cfg, make_mesh(validate(cfg, 1, origins), jax.devices()[:1]))
    _, metrics = trainer.step(trainer.init(),
                              global_batch(random_batch(cfg), trainer.batch_sharding))
    return jax.device_get(metrics)


@pytest.mark.slow
def test_stacked_and_unrolled_layers_give_the_same_per_layer_metrics():
    """Shapes [L_moe] / [L_moe, E] / [L], the same values with model.scan_layers=false (rtol
    1e-5), and every parameter in exactly one gradient group: the groups' squared norms sum
    to the global grad_norm's square (rtol 1e-5, float32 sums)."""
    stacked, unrolled = one_step(), one_step("model.scan_layers=false")
    shapes = {"router_entropy": (2,), "dropped_fraction_by_layer": (2,), "expert_load": (2, 8),
              "activation_rms_by_layer": (3,), "update_ratio_by_layer": (3,)}
    assert {k: np.shape(stacked[k]) for k in PER_LAYER} == shapes
    groups = {k: np.shape(v) for k, v in stacked["grad_norm_by_group"].items()}
    assert groups == {"attention": (3,), "norms": (3,), "dense_mlp": (1,), "router": (2,),
                      "experts": (2,), "shared": (2,), "embedding": (), "head": ()}
    for key in PER_LAYER:
        np.testing.assert_allclose(unrolled[key], stacked[key], rtol=1e-5, err_msg=key)
    for group, value in stacked["grad_norm_by_group"].items():
        np.testing.assert_allclose(unrolled["grad_norm_by_group"][group], value, rtol=1e-5)
    squares = sum(np.sum(np.square(np.float64(v))) for v in stacked["grad_norm_by_group"].values())
    np.testing.assert_allclose(np.sqrt(squares), stacked["grad_norm"], rtol=1e-5)
    assert 0 < np.min(stacked["router_entropy"]) <= np.log(8) + 1e-6


def starve_experts(monkeypatch, experts=(0, 1)):
    """Every router's selection bias starts at -1e9 for `experts`: they never get a token."""
    def starving(value, **kwargs):
        return RouterBias(value.at[np.asarray(experts)].set(-1e9), **kwargs)
    monkeypatch.setattr(moe, "RouterBias", starving)


def train(tmp_path, monkeypatch, name, *extra):
    """The real loop on one device: MoE layers 1-2 and one MTP depth (layer 3), sigmoid
    routing (so a router_bias), every step logged."""
    cfg, origins = small_config(
        "model.remat_policy=none", "model.mtp_depth=1", "moe.router=sigmoid",
        "train.steps=4", "checkpoint.enabled=false", "logging.every_steps=1",
        "logging.progress_bar=false", "guard.dead_expert_windows=2", f"run.dir={tmp_path / name}",
        *extra)
    monkeypatch.setattr(evaluate, "load_tokenizer", lambda *a, **k: _Tokenizer())
    monkeypatch.setattr(loop, "make_dataset", lambda *a, **k: _fake_data(cfg, {}))
    monkeypatch.setattr(setup, "make_mesh", lambda sizes, **_: make_mesh(sizes, jax.devices()[:1]))
    try:
        loop.train(cfg, validate(cfg, 1, origins))
    finally:
        records, events = ([json.loads(line) for line in path.open()] if path.exists() else []
                           for path in (tmp_path / name / "metrics.jsonl",
                                        tmp_path / name / "events.jsonl"))
    return records, [(e["step"], e["kind"], e["message"]) for e in events]


@pytest.mark.slow
def test_jsonl_arrays_and_a_starved_router(tmp_path, monkeypatch):
    """metrics.jsonl holds [L_moe, E] = [3, 8] arrays (MTP's MoE last) on every logged step;
    experts 0 and 1, starved by their bias, are dead after 2 windows: a warning and one
    "dead_experts" event (router_action=warn), or the run stops naming them (stop)."""
    starve_experts(monkeypatch)
    records, events = train(tmp_path, monkeypatch, "warn", "guard.router_action=warn")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        fraction = np.array(r["expert_load_fraction"])
        assert fraction.shape == (3, 8) and np.array(r["router_bias"]).shape == (3, 8)
        np.testing.assert_allclose(fraction.sum(axis=1), 1.0, rtol=1e-6)
        assert np.all(fraction[:, :2] == 0) and np.all(fraction[:, 2:] > 0)
        for key in ("router_entropy", "dropped_fraction_by_layer", "load_max_mean_ratio",
                    "load_cv"):
            assert np.shape(r[key]) == (3,), key
        assert np.shape(r["activation_rms_by_layer"]) == (4,)  # 3 layers + MTP
        assert np.shape(r["update_ratio_by_layer"]) == (4,)
        assert np.shape(r["grad_norm_by_group"]["router"]) == (3,)
        assert np.shape(r["grad_norm_by_group"]["mtp_projection"]) == (1,)
    dead = {"1": [0, 1], "2": [0, 1], "3": [0, 1]}
    assert [r["dead_experts"] for r in records] == [{}, dead, dead, dead]
    assert records[-1]["dead_expert_count"] == 6
    assert [e[:2] for e in events] == [(2, "dead_experts")]
    assert "layer 1: experts 0, 1; layer 2: experts 0, 1; layer 3: experts 0, 1" in events[0][2]

    with pytest.raises(TrainingStopped, match=r"step 2: dead experts .* layer 1: experts 0, 1"):
        train(tmp_path, monkeypatch, "stop", "guard.router_action=stop")
