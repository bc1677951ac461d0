"""Stability guards: the in-step decision (StepGuard), the host decision (Guard), and a real
training loop that meets a NaN batch (skipped) and a loss spike (rolled back) and still ends
where a clean run ends."""

import json

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.config import CheckpointConfig, GuardConfig
from maxmoe.sharding import make_mesh
from maxmoe.train import evaluate, loop, setup
from maxmoe.train.checkpoint import Checkpointer
from maxmoe.train.guards import Action, Guard, StepGuard, TrainingStopped
from maxmoe.validation import validate
from tests.helpers import small_config
from tests.train.test_precision import learnable_batch


def run_guard(guard: StepGuard, values):
    """Feeds (loss, grad_norm, finite) triples through check(); returns the flags per step."""
    state, out = guard.init(), []
    check = jax.jit(guard.check)
    for loss, grad_norm, finite in values:
        apply, state, metrics = check(state, jnp.float32(loss), jnp.float32(grad_norm),
                                      jnp.asarray(finite))
        out.append({k: float(v) for k, v in metrics.items()} | {"apply": bool(apply)})
    return out, jax.device_get(state)


def test_spike_is_skipped_and_kept_out_of_the_statistics():
    guard = StepGuard(window=8, zscore=6.0, ceiling=1e3, spikes=True)
    rng = np.random.default_rng(0)
    steady = [(2.0 + 0.05 * rng.standard_normal(), 1.0 + 0.05 * rng.standard_normal(), True)
              for _ in range(12)]
    out, state = run_guard(guard, steady + [(9.0, 1.0, True), (2.0, 1.0, True),
                                            (2.0, 30.0, True)])
    assert all(o["apply"] for o in out[:12])  # noise on a plateau is not a spike
    assert out[12]["spike"] and not out[12]["apply"] and out[12]["loss_zscore"] > 6
    assert out[13]["apply"] and out[13]["consecutive_skips"] == 0
    assert out[14]["spike"] and out[14]["grad_norm_zscore"] > 6  # a grad-norm spike alone
    assert int(state["skipped_steps"]) == 2 and int(state["history_count"]) == 13
    assert 9.0 not in np.asarray(state["loss_history"])


def test_no_spike_judgement_before_the_window_is_full():
    guard = StepGuard(window=8, zscore=6.0, ceiling=0.0, spikes=True)
    out, _ = run_guard(guard, [(5.0, 1.0, True), (1.0, 1.0, True), (50.0, 1.0, True)])
    assert all(o["apply"] for o in out)


def test_non_finite_and_ceiling_skip_and_count():
    guard = StepGuard(window=4, zscore=6.0, ceiling=100.0, spikes=False)
    out, state = run_guard(guard, [(1.0, 1.0, True), (float("nan"), 1.0, True),
                                   (1.0, 1.0, False), (1.0, 500.0, True), (1.0, 1.0, True)])
    assert [o["apply"] for o in out] == [True, False, False, False, True]
    assert out[1]["nonfinite"] and out[2]["nonfinite"] and out[3]["over_ceiling"]
    assert [o["consecutive_skips"] for o in out] == [0, 1, 2, 3, 0]
    assert int(state["skipped_steps"]) == 3


def observe(cfg: GuardConfig, **metrics):
    logged = []
    decision = Guard(cfg, log=logged.append).observe(7, {"loss": 2.0, "grad_norm": 1.0, **metrics})
    return decision, logged


def test_host_decisions():
    """The host's reading of the step's guard flags: a clean step continues; a non-finite step
    is skipped with a message naming the step, until max_consecutive_skips in a row stops the
    run; a spike rolls back; a gradient norm over the ceiling and a loss scale at its minimum
    stop the run naming the setting; large activation RMS and update ratios are logged."""
    cfg = GuardConfig(max_consecutive_skips=3, spike_action="rollback", max_rollbacks=1)
    assert observe(cfg, skipped=0)[0].action is Action.CONTINUE
    d, _ = observe(cfg, skipped=1, nonfinite=1, consecutive_skips=1)
    assert d.action is Action.SKIPPED and "non-finite" in d.message and "step 7" in d.message
    d, _ = observe(cfg, skipped=1, nonfinite=1, consecutive_skips=3)
    assert d.action is Action.STOP and "3 updates in a row" in d.message
    assert observe(cfg, skipped=1, spike=1, consecutive_skips=1)[0].action is Action.ROLLBACK
    d, _ = observe(cfg, skipped=1, over_ceiling=1, grad_norm=5e3)
    assert d.action is Action.STOP and "5000" in d.message and "grad_norm_ceiling" in d.message
    d, _ = observe(cfg, skipped=1, nonfinite=1, loss_scale_at_min=1, loss_scale=1.0)
    assert d.action is Action.STOP and "minimum loss scale" in d.message
    _, logged = observe(cfg, activation_rms_max=500.0, update_ratio_max=0.5)
    assert len(logged) == 2 and "activation_rms_max" in logged[0]


def _fake_data(cfg, poison: dict[int, str]):
    """A checkpointable grain dataset of learnable batches; poison: batch index -> kind."""
    def make(i):
        batch = learnable_batch(cfg, int(i))
        if poison.get(int(i)) == "nan":
            batch["loss_mask"][0, 0] = np.nan
        elif poison.get(int(i)) == "huge":  # one target weighted 1e9: a finite, huge gradient
            batch["loss_mask"][0, 0] = 1e9
        elif poison.get(int(i)) == "spike":  # random targets: a loss far above the trend
            batch["targets"] = np.random.default_rng(int(i)).integers(
                1, cfg.model.vocab_size, batch["targets"].shape).astype(np.int32)
        return batch
    return grain.MapDataset.range(10_000).map(make).to_iter_dataset()


class _Tokenizer:
    vocab_size, path = 256, "fake"

    def save(self, directory):  # the loop saves the run's tokenizer; nothing to write here
        pass


def _train(tmp_path, monkeypatch, name, poison, *extra):
    """The real loop on one device; a dense model (guards do not care, and it compiles fast)."""
    cfg, origins = small_config(
        "model.remat_policy=none", "model.num_layers=2", "model.num_dense_layers=2",
        "train.steps=40", "optimizer.warmup_steps=5",
        "checkpoint.every_steps=10", "checkpoint.async_save=false", "logging.every_steps=1",
        "logging.progress_bar=false", "guard.spike_window=10", "guard.spike_action=rollback",
        f"run.dir={tmp_path / name}", *extra)
    monkeypatch.setattr(evaluate, "load_tokenizer", lambda *a, **k: _Tokenizer())
    monkeypatch.setattr(loop, "make_dataset", lambda *a, **k: _fake_data(cfg, poison))
    monkeypatch.setattr(setup, "make_mesh", lambda sizes, **_: make_mesh(sizes, jax.devices()[:1]))
    summary = loop.train(cfg, validate(cfg, 1, origins))
    records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
    return summary, records


@pytest.mark.slow
def test_poisoned_batches_are_skipped_or_rolled_back(tmp_path, monkeypatch, capsys):
    """Batch 15 has a NaN (skipped in the step), batch 35 a spike of random targets (rolled
    back to step 30, batches 30-35 skipped). Final loss within 0.1 nats of a clean run."""
    clean, _ = _train(tmp_path, monkeypatch, "clean", {})
    summary, records = _train(tmp_path, monkeypatch, "poisoned", {15: "nan", 35: "spike"})
    err = capsys.readouterr().err
    assert summary["final_step"] == 40
    assert "step 16: update skipped: non-finite" in err
    assert "rollback 1: step 36 was a spike; restored step 30 and skipped 6 data batches" in err
    by_step = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)
    assert by_step[16][0]["skipped"] == 1 and by_step[16][0]["nonfinite"] == 1
    assert len(by_step[36]) == 1 and by_step[36][0]["spike"] == 0  # the redone step 36
    assert by_step[40][-1]["skipped_steps"] == 1  # the rollback restored the counters of step 30
    events = [json.loads(line) for line in (tmp_path / "poisoned" / "events.jsonl").open()]
    assert [(e["step"], e["kind"]) for e in events] == [(16, "skip"), (36, "spike"),
                                                        (36, "rollback")]
    assert clean["first_loss"] > 5.0 and clean["last_loss"] < 3.0  # it learned
    timed = [r for r in records if r["step_time_s"]]  # every window but the first step's
    assert timed and all(r["data_wait_s"] >= 0 and r["host_time_s"] >= 0 and
                         0 <= r["host_overhead_fraction"] <= 1 and
                         0 < r["host_cpu_fraction"] <= 1 for r in timed)
    assert abs(summary["last_loss"] - clean["last_loss"]) < 0.1


@pytest.mark.slow
@pytest.mark.parametrize("bad_step", [14, 19])
def test_grad_norm_ceiling_stops_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, bad_step):
    """The loop reads a step's flags one step late; 19 is seen while step 20 (the last step,
    due for a checkpoint) is already running, and step 20 must not be saved either."""
    with pytest.raises(TrainingStopped, match=rf"step {bad_step}: global gradient norm .* "
                                              r"exceeds guard.grad_norm_ceiling=10"):
        _train(tmp_path, monkeypatch, "ceiling", {bad_step - 1: "huge"}, "train.steps=20",
               "guard.grad_norm_ceiling=10", "guard.spike_action=none")
    ckpt = Checkpointer(tmp_path / "ceiling" / "checkpoints", CheckpointConfig())
    assert ckpt.all_steps() == [10]  # the bad step (and the one after) neither applied nor saved
    ckpt.close()
    records = [json.loads(line) for line in (tmp_path / "ceiling" / "metrics.jsonl").open()]
    assert records[-1]["step"] == bad_step - 1  # nothing after the last good step was logged
