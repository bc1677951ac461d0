"""Router health: the device's logging-window counter, the host's figures and the guard's
dead-expert and load decisions (metrics/router_health.py, metrics/layers.py, train/guards.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.config import ConfigError, GuardConfig
from maxmoe.config_files import load_config
from maxmoe.metrics.layers import layer_record
from maxmoe.metrics.router_health import (
    dead_experts,
    describe_dead,
    init_window,
    load_stats,
    update_window,
)
from maxmoe.model.spec import moe_layer_indices
from maxmoe.train.guards import Action, Guard
from maxmoe.validation import validate


def run_windows(loads, closes):
    """Feeds per-step loads [L, E] through the jitted update_window; zero_windows per step."""
    state, out = init_window(*np.shape(loads[0])), []
    step = jax.jit(update_window)
    for load, close in zip(loads, closes, strict=True):
        state, zero = step(state, jnp.asarray(load, jnp.float32), jnp.asarray(close))
        out.append(np.asarray(zero))
    return out, jax.device_get(state)


def test_load_on_a_step_that_is_not_logged_keeps_an_expert_alive():
    """Windows of 3 steps (logged at steps 3, 6, 9, 12). Expert 1 gets tokens only on step 5,
    a step that is not logged: window 2 is not a zero window for it. Expert 2 never gets any:
    one more zero window at every close."""
    loads, closes = [], []
    for step in range(1, 13):
        load = np.array([[4.0, 0.0, 0.0, 2.0]])
        if step == 5:
            load[0, 1] = 1.0
        loads.append(load)
        closes.append(step % 3 == 0)
    zeros, state = run_windows(loads, closes)
    assert [int(z[0, 1]) for z in zeros] == [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 2]
    assert [int(z[0, 2]) for z in zeros[2::3]] == [1, 2, 3, 4]
    assert zeros[-1][0, 0] == zeros[-1][0, 3] == 0
    assert np.all(state["window_load"] == 0)  # reset at the last close
    assert dead_experts(zeros[-1], 3, [5]) == {"5": [2]}  # expert 1: only 2 windows in a row
    assert dead_experts(zeros[-1], 2, [5]) == {"5": [1, 2]}


def test_load_stats_of_a_collapsed_and_a_balanced_layer():
    """Reference by hand: [4, 0, 0, 0] has mean 1, max 4, population std sqrt(3)."""
    stats = load_stats(np.array([[4.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]]))
    np.testing.assert_allclose(stats["load_max_mean_ratio"], [4.0, 1.0], rtol=1e-12)
    np.testing.assert_allclose(stats["load_cv"], [np.sqrt(3.0), 0.0], rtol=1e-12, atol=1e-12)


def test_moe_rows_name_model_layers_with_mtp_last():
    cfg, _ = load_config([], ["model.num_layers=5", "model.num_dense_layers=1",
                              "model.dense_layer_indices=[3]", "model.mtp_depth=2"])
    assert moe_layer_indices(cfg.model) == [1, 2, 4, 5, 6]
    dense, _ = load_config([], ["model.num_layers=2", "model.num_dense_layers=2"])
    assert moe_layer_indices(dense.model) == []
    assert describe_dead({"2": [0, 7], "6": [3]}) == "layer 2: experts 0, 7; layer 6: expert 3"


class Recorder(list):
    """An EventLog that keeps (step, kind, message) in memory."""

    def emit(self, step, kind, message):
        self.append((step, kind, message))


def observe_router(cfg, zero_windows, step=30, load=None, ratio=1.0, guard=None):
    events = Recorder()
    guard = guard or Guard(cfg, log=lambda _: None, moe_layers=[1, 2], events=events)
    metrics = {"skipped": 0, "expert_zero_windows": np.asarray(zero_windows),
               "load_max_mean_ratio_max": ratio}
    if load is not None:
        metrics["expert_load"] = np.asarray(load, np.float32)
    return guard.observe(step, metrics), events, guard


def test_router_action_stop_names_the_layer_and_experts():
    cfg = GuardConfig(dead_expert_windows=3, router_action="stop")
    zero = np.zeros((2, 4), np.int32)
    assert observe_router(cfg, zero)[0].action is Action.CONTINUE
    zero[1, [0, 3]] = 3
    zero[0, 2] = 2  # not yet dead
    decision, events, _ = observe_router(cfg, zero)
    assert decision.action is Action.STOP
    assert "layer 2: experts 0, 3" in decision.message and "layer 1" not in decision.message
    assert "guard.router_action" in decision.message
    assert events == [(30, "stop", decision.message)]


def test_router_action_warn_reports_each_change_once():
    cfg = GuardConfig(dead_expert_windows=2, router_action="warn")
    zero = np.zeros((2, 4), np.int32)
    zero[0, 1] = 2
    decision, events, guard = observe_router(cfg, zero)
    assert decision.action is Action.CONTINUE and len(events) == 1
    assert events[0][1] == "dead_experts" and "layer 1: expert 1" in events[0][2]
    events.clear()
    guard.events = events
    observe_router(cfg, zero, step=31, guard=guard)  # unchanged: nothing new
    assert events == []
    observe_router(cfg, np.zeros((2, 4), np.int32), step=40, guard=guard)  # revived
    assert [e[:2] for e in events] == [(40, "dead_experts")] and "no dead" in events[0][2]


def test_load_ratio_warning_names_the_layer_and_busiest_expert():
    cfg = GuardConfig(load_ratio_warn=3.0)
    load = [[1.0, 1.0, 1.0, 1.0], [0.0, 7.0, 1.0, 0.0]]  # layer 2: max 7 / mean 2 = 3.5
    decision, events, _ = observe_router(cfg, np.zeros((2, 4), np.int32), load=load, ratio=3.5)
    assert decision.action is Action.CONTINUE
    assert len(events) == 1 and events[0][1] == "router"
    assert "layer 2: 3.5 (expert 1)" in events[0][2] and "layer 1" not in events[0][2]
    off = GuardConfig(load_ratio_warn=0.0)
    assert observe_router(off, np.zeros((2, 4), np.int32), load=load, ratio=3.5)[1] == []


def test_layer_record_is_json_ready():
    host = {"expert_load": np.array([[3.0, 1.0], [2.0, 2.0]], np.float32),
            "expert_zero_windows": np.array([[0, 4], [0, 0]], np.int32),
            "router_entropy": np.array([0.5, np.inf], np.float32),
            "update_ratio_by_layer": np.full(3, np.nan, np.float32),
            "grad_norm_by_group": {"router": np.array([1.0, 2.0]), "head": np.float32(3.0)}}
    rec = layer_record(host, per_layer=True, dead_windows=3, layers=[1, 2],
                       logged_only=("update_ratio_by_layer",))
    assert rec["expert_load_fraction"] == [[0.75, 0.25], [0.5, 0.5]]
    assert rec["router_entropy"] == [0.5, None]  # non-finite -> null
    assert "update_ratio_by_layer" not in rec  # not computed on this step
    assert rec["grad_norm_by_group"] == {"router": [1.0, 2.0], "head": 3.0}
    assert rec["dead_experts"] == {"1": [1]} and rec["dead_expert_count"] == 1
    np.testing.assert_allclose(rec["load_max_mean_ratio"], [1.5, 1.0])
    scalars_only = layer_record(host, per_layer=False, dead_windows=3, layers=[1, 2])
    assert set(scalars_only) == {"dead_experts", "dead_expert_count"}


@pytest.mark.parametrize("action", ["stop", "warn"])
def test_router_action_config_is_checked(action):
    cfg, origins = load_config([], [f"guard.router_action={action}"])
    validate(cfg, 1, origins)
    bad, origins = load_config([], ["guard.router_action=panic"])
    with pytest.raises(ConfigError, match="guard.router_action"):
        validate(bad, 1, origins)
