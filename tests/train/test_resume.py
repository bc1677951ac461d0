"""Resume is exact: 2N steps straight equal N steps, restart, N more steps, bit for bit.

Runs the real loop (stdlib corpus, SentencePiece, grain, Orbax) on an 8-device mesh. The LR
schedule length is fixed by optimizer.decay_steps so it does not depend on train.steps.
"""

import json

import jax
import numpy as np
import pytest
from jax import monitoring

from maxmoe.plan.live import live_cluster, plan_writer
from maxmoe.sharding import make_mesh
from maxmoe.train.checkpoint import Checkpointer
from maxmoe.train.loop import train
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate
from tests.helpers import small_config
from tests.plan.test_dry_run import CONTRACT

COMMON = ["model.vocab_size=512", "mesh.fsdp=2", "mesh.expert=2", "optimizer.warmup_steps=2",
          "optimizer.decay_steps=10", "checkpoint.every_steps=3", "logging.every_steps=1",
          "logging.progress_bar=false", "checkpoint.async_save=true"]


def _run(tmp_path, name, steps):
    cfg, origins = small_config(*COMMON, f"train.steps={steps}", f"run.dir={tmp_path / name}")
    sizes = validate(cfg, jax.device_count(), origins)
    # plan.json is written by the hook `maxmoe train` passes
    return cfg, sizes, train(cfg, sizes, first_compiled=plan_writer(live_cluster("")))


def _final_state(cfg, sizes, tmp_path, name):
    trainer = make_trainer(cfg, make_mesh(sizes))
    ckpt = Checkpointer(tmp_path / name / "checkpoints", cfg.checkpoint)
    state, step = ckpt.restore(trainer.abstract_state)
    ckpt.close()
    return jax.device_get(state), step


@pytest.mark.slow
def test_restart_is_bit_identical(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXMOE_CACHE", str(tmp_path / "cache"))
    lowered = []  # the loop compiles the step ahead of its first call for plan.json: once

    def count(event, _, fun_name="", **__):
        lowered.extend([fun_name] if "mlir_module" in event else [])
    monitoring.register_event_duration_secs_listener(count)
    try:
        cfg, sizes, straight = _run(tmp_path, "straight", 6)
    finally:
        monitoring.unregister_event_duration_listener(count)
    assert lowered.count("jit(train_step)") == 1, lowered
    plan = json.loads((tmp_path / "straight" / "plan.json").read_text())
    assert CONTRACT <= set(plan), CONTRACT - set(plan)
    assert plan["fits"] is True and plan["mesh"]["fsdp"] == 2 and plan["devices"] == 8
    assert plan["overlap_source"] == "assumed"  # CPU devices: no GPU schedule to read
    assert straight["plan_json_s"] is not None
    _, _, first = _run(tmp_path, "resumed", 3)
    _, _, second = _run(tmp_path, "resumed", 6)
    assert (first["final_step"], second["start_step"], second["final_step"]) == (3, 3, 6)
    a, step_a = _final_state(cfg, sizes, tmp_path, "straight")
    b, step_b = _final_state(cfg, sizes, tmp_path, "resumed")
    assert step_a == step_b == 6
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
    # resuming continued the run instead of restarting it: steps 1..6 logged once each
    logged = [json.loads(line)["step"] for line in
              (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]
    # a finished run started again does nothing
    _, _, again = _run(tmp_path, "resumed", 6)
    assert again["start_step"] == again["final_step"] == 6
