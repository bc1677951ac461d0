"""Scheduled gradient clipping, the bfloat16 first moment, and the new config checks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from maxmoe.config import ConfigError, OptimizerConfig
from maxmoe.config_files import load_config
from maxmoe.train.optimizer import clip_by_scheduled_global_norm, clip_norm_schedule, make_optimizer
from maxmoe.validation import validate


def test_constant_schedule_matches_optax_clip_by_global_norm():
    """With a constant schedule the scheduled clip is optax.clip_by_global_norm: the same
    clipped leaves (global norm sqrt(91) > 2, so the clip acts), rtol 1e-6."""
    grads = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.full((4,), -3.0)}
    ours = clip_by_scheduled_global_norm(optax.constant_schedule(2.0))
    got, _ = ours.update(grads, ours.init(grads))
    want, _ = optax.clip_by_global_norm(2.0).update(grads, optax.EmptyState())
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_clip_takes_the_norm_the_step_passes_through_the_chain():
    """The train step hands its gradient norm to the clip (optax extra args through the
    chain): the clip then scales by that norm instead of computing its own."""
    grads = {"g": jnp.full((4,), 10.0)}  # global norm 20
    chained = optax.chain(clip_by_scheduled_global_norm(optax.constant_schedule(1.0)),
                          optax.identity())
    state = chained.init(grads)
    own, _ = chained.update(grads, state)
    given, _ = chained.update(grads, state, grad_norm=jnp.float32(20.0))
    np.testing.assert_allclose(given["g"], own["g"], rtol=1e-6)
    np.testing.assert_allclose(optax.tree.norm(own), 1.0, rtol=1e-6)
    told_40, _ = chained.update(grads, state, grad_norm=jnp.float32(40.0))
    np.testing.assert_allclose(optax.tree.norm(told_40), 0.5, rtol=1e-6)
    # the full optimizer (clip + masked AdamW) takes it too, and the true norm changes nothing
    adamw = make_optimizer(OptimizerConfig(), 10)
    params = {"g": jnp.ones((4,))}
    state = adamw.init(params)
    told, _ = adamw.update(grads, state, params, grad_norm=jnp.float32(20.0))
    itself, _ = adamw.update(grads, state, params)
    np.testing.assert_allclose(told["g"], itself["g"], rtol=1e-6)


def test_clip_norm_decays_linearly_then_holds():
    """grad_clip_norm 1.0 falls linearly to grad_clip_end_norm 0.3 over grad_clip_decay_steps
    10, then holds (the schedule's values, rtol 1e-6); a norm-20 gradient leaves the clip at
    norm 1.0 on step 0 and 0.3 on step 10 (rtol 1e-5), falling strictly between.
    grad_clip_norm 0 still builds an optimizer (no clipping)."""
    cfg = OptimizerConfig(grad_clip_norm=1.0, grad_clip_end_norm=0.3, grad_clip_decay_steps=10)
    schedule = clip_norm_schedule(cfg, total_steps=100)
    np.testing.assert_allclose([schedule(s) for s in (0, 5, 10, 50)], [1.0, 0.65, 0.3, 0.3],
                               rtol=1e-6)
    clip = clip_by_scheduled_global_norm(schedule)
    state = clip.init(None)
    grads = {"g": jnp.full((4,), 10.0)}  # norm 20: always clipped
    norms = []
    for _ in range(11):
        out, state = clip.update(grads, state)
        norms.append(float(optax.tree.norm(out)))
    np.testing.assert_allclose(norms[0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(norms[10], 0.3, rtol=1e-5)
    assert np.all(np.diff(norms) < 0)
    assert make_optimizer(OptimizerConfig(grad_clip_norm=0.0), 10)  # clipping off


def test_bfloat16_first_moment():
    """optimizer.moment_dtype=bfloat16 stores a 2-D param's first moment (mu) in bfloat16 and
    keeps its second moment (nu) in float32."""
    params = {"w": jnp.ones((3, 2))}
    state = make_optimizer(OptimizerConfig(moment_dtype="bfloat16"), 10).init(params)
    dtypes = {jax.tree_util.keystr(p): x.dtype
              for p, x in jax.tree_util.tree_leaves_with_path(state) if x.ndim == 2}
    assert sorted(str(d) for d in dtypes.values()) == ["bfloat16", "float32"], dtypes  # mu, nu


@pytest.mark.parametrize("override, key", [
    ("precision.loss_scaling=none", "precision.loss_scaling"),  # with float16
    ("precision.loss_scale_window=0", "precision.loss_scale_window"),
    ("optimizer.moment_dtype=float16", "optimizer.moment_dtype"),
    ("guard.spike_action=panic", "guard.spike_action"),
    ("guard.spike_window=1", "guard.spike_window"),
    ("model.remat_policy=selective", "model.remat_policy"),
])
def test_invalid_settings_name_their_key(override, key):
    cfg, origins = load_config([], ["precision.compute_dtype=float16", override])
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        validate(cfg, 8, origins)


def test_step_update_ratio_and_param_norm_equal_float64_numpy():
    """The step's update_ratio_by_layer metric is |new - old| / |old| of each decoder layer's params
    and param_norm the global norm of the new params. Reference: float64 NumPy from the
    params copied out before and after a step of the small MoE; rtol 1e-5 (float32 sums).
    Both are computed only on steps whose metrics the loop writes: NaN on step 1 of 2 with
    logging.every_steps=2."""
    from maxmoe.sharding import global_batch, make_mesh
    from maxmoe.train.step import make_trainer
    from tests.helpers import random_batch, small_config

    cfg, origins = small_config("model.remat_policy=none", "logging.every_steps=2")
    trainer = make_trainer(cfg, make_mesh(validate(cfg, 1, origins), jax.devices()[:1]))
    state = trainer.init()
    for step in range(2):  # the learning rate warms up from 0: the first step changes nothing
        before = jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(state["params"]))
        state, metrics = trainer.step(state, global_batch(random_batch(cfg, step),
                                                          trainer.batch_sharding))
        if step == 0:  # not a logged step
            assert np.isnan(float(metrics["param_norm"]))
            assert np.isnan(np.asarray(metrics["update_ratio_by_layer"])).all()
    after = jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(state["params"]))
    assert int(metrics["skipped"]) == 0
    want = []
    for group in sorted(before["layer_groups"]):
        old, new = (jax.tree.leaves(t["layer_groups"][group]) for t in (before, after))
        per_layer = lambda xs: sum(np.sum(np.square(x).reshape(x.shape[0], -1), axis=1)  # noqa
                                   for x in xs)
        want.append(np.sqrt(per_layer(n - o for n, o in zip(new, old, strict=True)) / per_layer(old)))
    want = np.concatenate(want)
    assert want.shape == (cfg.model.num_layers,) and np.all(want > 0)
    np.testing.assert_allclose(np.asarray(metrics["update_ratio_by_layer"]), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["param_norm"]),
                               np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(after))),
                               rtol=1e-5)


def test_update_ratios_of_per_layer_params_equal_the_stacked_ones():
    """scan_layers=false keeps each layer's params apart (int keys under a layer group): the
    same per-layer ratios as from the stacked layout. Reference: the stacked computation,
    which the float64 test above checks; rtol 1e-6 (float32 sums in another order)."""
    from maxmoe.metrics.diagnostics import update_ratios
    from tests.helpers import per_layer

    rng = np.random.default_rng(0)

    def group(n):
        return {"attn": {"q": rng.normal(size=(n, 4, 3)).astype(np.float32)},
                "norm": {"scale": rng.normal(size=(n, 4)).astype(np.float32)}}
    old = {"embed": rng.normal(size=(5, 4)), "layer_groups": {0: group(1), 1: group(3)}}
    new = jax.tree.map(lambda x: x + 0.01 * rng.normal(size=x.shape).astype(x.dtype), old)

    want = np.asarray(update_ratios(new, old))
    assert want.shape == (4,) and len(set(want.tolist())) == 4
    np.testing.assert_allclose(np.asarray(update_ratios(per_layer(new), per_layer(old))), want,
                               rtol=1e-6)

