"""The profiling window: its keys are checked before anything compiles, and `ProfileWindow`
traces exactly the steps asked for and prints metrics.profile's per-part table.

The loop wiring (whole steps of `maxmoe train`) is tested end to end in test_evaluate.py,
which shares one tiny run with the eval test."""

import json

import jax
import jax.numpy as jnp
import pytest

from maxmoe.config import ConfigError
from maxmoe.config_files import load_config
from maxmoe.train.profiling import ProfileWindow
from maxmoe.validation import validate


@pytest.mark.parametrize("overrides, key, problem", [
    (["logging.profile_start=-1"], "logging.profile_start", "must be >= 0"),
    (["logging.profile_start=5", "logging.profile_steps=0"], "logging.profile_steps",
     "must be >= 1 when logging.profile_start is set"),
    (["train.steps=10", "logging.profile_start=9", "logging.profile_steps=3"],
     "logging.profile_start", "traces steps 9-11, past train.steps = 10"),
    # YAML 1.1 reads 10:20 as the base-60 integer 620: why the window is two keys
    (["train.steps=100", "logging.profile_start=10:20"], "logging.profile_start",
     "traces steps 620-622, past train.steps = 100"),
])
def test_bad_window_is_one_line_config_error(overrides, key, problem):
    cfg, origins = load_config([], overrides)
    with pytest.raises(ConfigError) as e:
        validate(cfg, 8, origins)
    message = str(e.value)
    assert "\n" not in message and f"config key '{key}'" in message and problem in message


def test_window_off_and_passed_windows_give_none(tmp_path):
    logged = []
    cfg, _ = load_config([], [])
    assert ProfileWindow.from_config(cfg, tmp_path, 1, logged.append) is None  # 0 = off
    cfg, _ = load_config([], ["logging.profile_start=3", "logging.profile_steps=2"])
    assert ProfileWindow.from_config(cfg, tmp_path, 3, logged.append) is not None
    assert ProfileWindow.from_config(cfg, tmp_path, 4, logged.append) is None  # resumed past it
    assert logged == ["profile: steps 3-4 were run before this resume at step 4; not traced "
                      "(raise logging.profile_start)"]


def test_traces_only_the_window_and_prints_the_breakdown(tmp_path):
    """Steps 2 and 3 of 5 of a jitted matmul loop: the trace starts before step 2 and stops
    after step 3, and the table accounts for time."""
    logged = []
    window = ProfileWindow(2, 2, tmp_path / "profile", logged.append)

    @jax.jit
    def step(x):
        return jnp.tanh(x @ x), {"loss": x.sum()}

    x = jnp.ones((64, 64)) / 64
    window.compiled = step.lower(x).compile()
    spent = []
    for done in range(1, 6):
        started = window.before(done, x)
        assert started == (done == 2) and window.tracing == (2 <= done <= 3)
        x, metrics = step(x)
        spent.append(window.after(done, (x, metrics)))
        assert window.tracing == (2 <= done < 3)
    assert spent[:2] == [None, None] and spent[2] >= 0 and spent[3:] == [None, None]
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert list((tmp_path / "profile").rglob("*.trace.json.gz"))
    parts = json.loads((tmp_path / "profile" / "breakdown.json").read_text())["parts"]
    assert sum(r["total_ms"] for r in parts) > 0
    assert (tmp_path / "profile" / "train_step.hlo.txt").read_text().startswith("HloModule")
    (message,) = logged
    assert message.startswith("profile: steps 2-3 traced into")
    assert "part " in message and "fwd ms" in message and "costliest ops:" in message
    window.close()  # nothing running: a no-op
