"""Dispatch under a deliberately skewed router: dropless keeps every token, capacity mode
drops exactly the predicted count (slots per sequence, so the same count on every mesh), on
one device and expert-parallel over 8 devices.

Reference: a float64 NumPy computation of the kept assignments' expert outputs.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.config import DEFAULT_RULES, MoEConfig
from maxmoe.parallel.capacity import capacity_slots
from maxmoe.parallel.experts import routed_experts
from maxmoe.sharding import make_mesh, named, use_mesh

E, K, D, F = 8, 2, 16, 8
B, S = 8, 16  # 128 tokens


def _weights():
    keys = jax.random.split(jax.random.key(0), 3)
    return (0.3 * jax.random.normal(keys[0], (E, D, F)), 0.3 * jax.random.normal(keys[1], (E, D, F)),
            0.3 * jax.random.normal(keys[2], (E, F, D)))


def _expert_np(x, wg, wu, wd, e):
    x, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, wg[e], wu[e], wd[e]))
    h = x @ wg
    return (h / (1 + np.exp(-h)) * (x @ wu)) @ wd


def _skewed():
    x = jax.random.normal(jax.random.key(1), (B, S, D))
    idx = jnp.zeros((B, S, K), jnp.int32).at[..., 1].set(3)  # every token: experts 0 and 3
    weights = jnp.full((B, S, K), 0.5)
    return x, idx, weights


def _run(cfg, mesh_sizes=None):
    x, idx, weights = _skewed()
    wg, wu, wd = _weights()
    run = jax.jit(lambda *a: routed_experts(*a, cfg))
    if mesh_sizes is None:
        y, stats = run(x, idx, weights, wg, wu, wd)
        return y, stats["dropped_fraction"]
    mesh = make_mesh(mesh_sizes)
    with use_mesh(mesh, DEFAULT_RULES):
        args = (jax.device_put(a, named(("batch", "seq", None))) for a in (x, idx, weights))
        wargs = [jax.device_put(w, named(axes)) for w, axes in
                 zip((wg, wu, wd), [("experts", "embed", "expert_mlp")] * 2
                     + [("experts", "expert_mlp", "embed")], strict=True)]
        y, stats = run(*args, *wargs)
        return y, stats["dropped_fraction"]


MESHES = {"one device": None,
          "data2 expert4": dict(data=2, fsdp=1, pipeline=1, expert=4, tensor=1),
          "expert8": dict(data=1, fsdp=1, pipeline=1, expert=8, tensor=1),
          "fsdp2 expert2 tensor2": dict(data=1, fsdp=2, pipeline=1, expert=2, tensor=2)}


@pytest.mark.parametrize("grouped_matmul", ["ragged_dot", "blocked"])
@pytest.mark.parametrize("mesh", list(MESHES))
def test_dropless_keeps_every_token_under_skew(mesh, grouped_matmul):
    cfg = MoEConfig(num_experts=E, experts_per_token=K, grouped_matmul=grouped_matmul,
                    block_size=8)
    y, dropped = _run(cfg, MESHES[mesh])
    x, _, _ = _skewed()
    wg, wu, wd = _weights()
    xf = np.asarray(x).reshape(-1, D)
    ref = 0.5 * _expert_np(xf, wg, wu, wd, 0) + 0.5 * _expert_np(xf, wg, wu, wd, 3)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), ref, rtol=1e-4, atol=1e-5)
    assert float(dropped) == 0.0


@pytest.mark.parametrize("mesh", list(MESHES))
def test_capacity_drops_exactly_the_predicted_count(mesh):
    cfg = MoEConfig(num_experts=E, experts_per_token=K, dispatch="capacity", capacity_factor=1.0)
    y, dropped = _run(cfg, MESHES[mesh])
    capacity = math.ceil(1.0 * S * K / E)  # slots per expert per sequence, whatever the mesh
    # experts 0 and 3 each get S assignments per sequence and keep `capacity` of them
    predicted = B * 2 * (S - capacity)
    assert 0 < predicted < B * S * K
    assert float(dropped) == pytest.approx(predicted / (B * S * K))
    # the first `capacity` tokens of each sequence (position policy) got both experts
    x, _, _ = _skewed()
    wg, wu, wd = _weights()
    x, y = np.asarray(x), np.asarray(y)
    for r in range(B):
        kept = x[r, :capacity]
        ref = 0.5 * _expert_np(kept, wg, wu, wd, 0) + 0.5 * _expert_np(kept, wg, wu, wd, 3)
        np.testing.assert_allclose(y[r, :capacity], ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(y[r, capacity:], 0.0, atol=1e-6)


def test_probability_policy_keeps_the_highest_weights():
    rng = np.random.default_rng(0)
    t = 32
    idx = jnp.zeros((t, 1), jnp.int32)
    weights = jnp.asarray(rng.random((t, 1)), jnp.float32)
    slots = np.asarray(capacity_slots(idx, weights, 4, 5, "probability"))[:, 0]
    kept = set(np.flatnonzero(slots >= 0))
    assert kept == set(np.argsort(-np.asarray(weights)[:, 0])[:5])
    assert sorted(slots[slots >= 0]) == list(range(5))
    by_position = np.asarray(capacity_slots(idx, weights, 4, 5, "position"))[:, 0]
    assert list(np.flatnonzero(by_position >= 0)) == [0, 1, 2, 3, 4]
