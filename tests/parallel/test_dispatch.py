"""The dropless all-to-all transport under worst-case routing, and moe.transport's rules.

Reference: the same routed_experts on one device (no mesh, `dropless_local`), float32; forward
and gradients within rtol 1e-4, atol 1e-5 (observed ~1e-6: only the order of float32 sums
differs). The round count is checked against its definition: max over (source, destination)
pairs of ceil(count / cap), cap = ceil(c T K / ep).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxmoe.config import DEFAULT_RULES, ConfigError, MoEConfig
from maxmoe.parallel.dispatch import (
    AUTO_ALL_GATHER_MAX_EP,
    AllToAll,
    ExpertShards,
    choose_transport,
    describe_transport,
)
from maxmoe.parallel.experts import routed_experts
from maxmoe.plan.gpu_aot import gpu_devices, unknown_trip_loops
from maxmoe.sharding import make_mesh, named, use_mesh
from maxmoe.validation import validate
from tests.helpers import small_config

E, K, D, F = 8, 2, 16, 8
B, S = 8, 16  # 128 tokens
MESHES = {"expert8": dict(data=1, fsdp=1, pipeline=1, expert=8, tensor=1),
          "data2 expert4": dict(data=2, fsdp=1, pipeline=1, expert=4, tensor=1),
          "fsdp2 expert2 tensor2": dict(data=1, fsdp=2, pipeline=1, expert=2, tensor=2),
          # batch not sharded over expert: every expert shard holds the same tokens
          "data2 expert4, tokens replicated": dict(data=2, fsdp=1, pipeline=1, expert=4,
                                                   tensor=1)}
RULES = dict(DEFAULT_RULES, batch=["data", "fsdp"])
W_AXES = [("experts", "embed", "expert_mlp")] * 2 + [("experts", "expert_mlp", "embed")]


def _inputs():
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (B, S, D))
    # worst case: every token to experts 0 and 1, which both live on expert shard 0 whenever
    # a shard holds 2 or more experts (on 8 shards: shards 0 and 1)
    idx = jnp.zeros((B, S, K), jnp.int32).at[..., 1].set(1)
    weights = jax.random.uniform(keys[1], (B, S, K))
    wg, wu = (0.3 * jax.random.normal(k, (E, D, F)) for k in keys[2:4])
    return x, idx, weights, wg, wu, 0.3 * jax.random.normal(keys[4], (E, F, D))


def _loss_and_grads(cfg, x, idx, weights, wg, wu, wd):
    def loss(x, weights, wg, wu, wd):
        y, stats = routed_experts(x, idx, weights, wg, wu, wd, cfg)
        return jnp.sum(jnp.sin(y)), (y, stats)
    (_, (y, stats)), grads = jax.value_and_grad(loss, argnums=range(5), has_aux=True)(
        x, weights, wg, wu, wd)
    return y, stats, grads


def sharded_equals_one_device(cfg, args, sizes: dict, rules) -> dict:
    """Asserts that routed_experts' output and gradients on a mesh of `sizes` under `rules`
    (tokens split over the batch, weights over W_AXES) equal one device's for `args`
    (x, idx, weights, w_gate, w_up, w_down); returns the sharded run's stats."""
    y_ref, _, g_ref = jax.jit(functools.partial(_loss_and_grads, cfg))(*args)
    x, idx, weights, wg, wu, wd = args
    with use_mesh(make_mesh(sizes), rules):
        tok = [jax.device_put(a, named(("batch", "seq", None))) for a in (x, idx, weights)]
        ws = [jax.device_put(w, named(a)) for w, a in zip((wg, wu, wd), W_AXES, strict=True)]
        y, stats, grads = jax.jit(functools.partial(_loss_and_grads, cfg))(*tok, *ws)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
    for name, g, r in zip(("x", "weights", "w_gate", "w_up", "w_down"), grads, g_ref,
                          strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=name)
    return stats


@pytest.mark.parametrize("mesh, grouped_matmul", [(m, "blocked") for m in MESHES]
                         + [("expert8", "ragged_dot")])  # the two backward forms of exchange_rounds
def test_all_to_all_equals_one_device_under_worst_case_routing(mesh, grouped_matmul):
    cfg = MoEConfig(num_experts=E, experts_per_token=K, transport="all_to_all",
                    transport_buffer_factor=1.5, grouped_matmul=grouped_matmul, block_size=8)
    sizes = MESHES[mesh]
    replicated = mesh.endswith("replicated")
    stats = sharded_equals_one_device(cfg, _inputs(), sizes,
                                      RULES if replicated else DEFAULT_RULES)
    # rounds by definition: T local tokens per batch shard, all K assignments of a source go
    # to shard 0 (2+ experts a shard) or 1 per destination (one expert a shard)
    ep = sizes["expert"]
    t = B * S // (sizes["data"] * sizes["fsdp"] * (1 if replicated else ep))
    group = 1 if replicated else ep  # replicated tokens: each shard keeps its own experts'
    cap = math.ceil(1.5 * t * K / group)
    pair = t * K if E // ep >= 2 else t
    assert float(stats["dispatch_rounds"]) == math.ceil(pair / cap)
    assert replicated or math.ceil(pair / cap) > 1  # (nothing travels when replicated)
    assert float(stats["dropped_fraction"]) == 0.0


def _a2a_on(mesh, cfg, ragged):
    shards = ExpertShards(axes=("expert",), sizes=(mesh.shape["expert"],),
                          gathered=("expert",), sync=("expert",))

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("expert"),) * 6,
                       out_specs=(P("expert"), P()), check_vma=False)
    def body(x, idx, w, wg, wu, wd):
        y, _, rounds = AllToAll(cfg, shards, ragged=ragged)(x, idx, w, wg, wu, wd)
        return y, rounds
    return body


def test_gpu_form_lowers_with_ragged_all_to_all():
    """The GPU exchange (ragged_all_to_all, which XLA:CPU cannot compile) lowers, forward and
    backward; lowering only, no compile."""
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    cfg = MoEConfig(num_experts=E, experts_per_token=K, grouped_matmul="ragged_dot")
    x, idx, weights, wg, wu, wd = _inputs()
    args = (x.reshape(-1, D), idx.reshape(-1, K), weights.reshape(-1, K), wg, wu, wd)
    body = _a2a_on(mesh, cfg, ragged=True)
    text = jax.jit(jax.grad(lambda *a: jnp.sum(body(*a)[0]), argnums=(0, 3))).lower(
        *args).as_text()
    assert "ragged_all_to_all" in text
    dense = jax.jit(_a2a_on(mesh, cfg, ragged=False)).lower(*args).as_text()
    assert "ragged_all_to_all" not in dense and "all_to_all" in dense


@pytest.mark.gpu_aot
def test_gpu_form_compiles_for_gpu_without_a_device():
    """Deviceless XLA:GPU compile of the transport's forward and backward (the venv with
    jax[cuda12], docs/gpu_aot.md; skipped without the plugin): ragged-all-to-all in the HLO,
    and the rounds loops have known trip counts (no host sync a round)."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="jax[cuda12] plugin not installed")
    mesh = jax.sharding.Mesh(gpu_devices(4, "h100"), ("expert",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    cfg = MoEConfig(num_experts=E, experts_per_token=K, grouped_matmul="ragged_dot")
    rows = jax.sharding.NamedSharding(mesh, P("expert"))
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows) for a in (
        jnp.zeros((4 * 64, D)), jnp.zeros((4 * 64, K), jnp.int32), jnp.zeros((4 * 64, K)),
        *_inputs()[3:])]
    body = _a2a_on(mesh, cfg, ragged=True)
    hlo = jax.jit(jax.grad(lambda *a: jnp.sum(body(*a)[0]), argnums=(0, 3))).lower(
        *args).compile().as_text()
    assert "ragged-all-to-all" in hlo
    assert unknown_trip_loops(hlo) == []


@pytest.mark.parametrize("transport, ep, hosts, chosen", [
    ("auto", 8, 1, "all_gather"), ("auto", AUTO_ALL_GATHER_MAX_EP * 2, 1, "all_to_all"),
    ("auto", 8, 2, "all_to_all"), ("auto", 2, 1, "all_gather"),
    ("all_to_all", 2, 1, "all_to_all"), ("all_gather", 64, 8, "all_gather"),
    ("two_level", 64, 8, "two_level")])
def test_auto_picks_as_documented(transport, ep, hosts, chosen):
    assert choose_transport(MoEConfig(transport=transport), ep, hosts) == chosen


def test_start_up_line_names_the_choice():
    cfg, origins = small_config("mesh.expert=8", "mesh.data=1")
    line = describe_transport(cfg, validate(cfg, 8, origins))
    assert "transport all_gather over 8 expert shards (auto" in line
    cfg, origins = small_config("mesh.expert=4", "mesh.dcn_expert=2", "mesh.data=2")
    assert "transport all_to_all over 4" in describe_transport(cfg, validate(cfg, 8, origins))
    cfg, origins = small_config("mesh.data=8")
    assert describe_transport(cfg, validate(cfg, 8, origins)) is None


@pytest.mark.parametrize("overrides, message", [
    (["moe.transport=ragged"], "moe.transport.*unknown transport"),
    (["moe.transport=all_to_all", "moe.dispatch=capacity"], "moe.transport.*capacity"),
    (["moe.transport_buffer_factor=0"], "moe.transport_buffer_factor.*> 0"),
    (["moe.transport_rounds=-1"], "moe.transport_rounds.*>= 0; use 0"),
    (["moe.overlap_chunks=0"], "moe.overlap_chunks.*>= 1; use 1"),
    (["moe.overlap_chunks=2", "moe.dispatch=capacity"], "moe.overlap_chunks.*capacity")])
def test_bad_transport_settings_name_key_and_fix(overrides, message):
    cfg, origins = small_config(*overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 8, origins)


def test_repeated_expert_ids_past_the_static_rounds_are_counted_as_dropped():
    """The static round count assumes a token's K experts are distinct (the router's top-k).
    Both of a token's assignments to expert 0 break that: what no round carries is counted in
    dropped_fraction, never lost silently."""
    cfg = MoEConfig(num_experts=E, experts_per_token=K, transport="all_to_all",
                    transport_buffer_factor=1.5, grouped_matmul="blocked", block_size=8)
    x, _, weights, wg, wu, wd = _inputs()
    idx = jnp.zeros((B, S, K), jnp.int32)  # every assignment to expert 0 (shard 0 of 8)
    with use_mesh(make_mesh(MESHES["expert8"]), DEFAULT_RULES):
        _, stats, _ = jax.jit(functools.partial(_loss_and_grads, cfg))(x, idx, weights, wg, wu,
                                                                         wd)
    t = B * S // 8
    cap = math.ceil(1.5 * t * K / 8)
    rounds = math.ceil(t / cap)  # worst_rounds: t tokens x min(K, 1 expert a shard)
    assert float(stats["dropped_fraction"]) == (t * K - rounds * cap) * 8 / (B * S * K) > 0
    assert float(stats["dispatch_rounds"]) == math.ceil(t * K / cap)  # what the data needed


def test_fewer_static_rounds_drop_the_overflow_and_count_it():
    """moe.transport_rounds 1 under the worst-case routing: each pair sends cap of its
    assignments; the rest are dropped and counted, and the output equals one device's with
    the dropped assignments' router weights zeroed (float32, rtol 1e-4, atol 1e-5)."""
    cfg = MoEConfig(num_experts=E, experts_per_token=K, transport="all_to_all",
                    transport_buffer_factor=1.5, transport_rounds=1, grouped_matmul="blocked",
                    block_size=8)
    x, idx, weights, wg, wu, wd = _inputs()
    with use_mesh(make_mesh(MESHES["expert8"]), DEFAULT_RULES):
        y, stats, _ = jax.jit(functools.partial(_loss_and_grads, cfg))(x, idx, weights, wg, wu,
                                                                         wd)
    t = B * S // 8  # tokens per device; expert k of every token lives on shard k
    cap = math.ceil(1.5 * t * K / 8)
    assert float(stats["dropped_fraction"]) == (t - cap) * K * 8 / (B * S * K)
    # kept: each device's first cap tokens (token order within a pair), both of their experts
    kept = (jnp.arange(B * S) % t < cap).reshape(B, S, 1)
    y_ref, _, _ = jax.jit(functools.partial(_loss_and_grads, cfg))(
        x, idx, jnp.where(kept, weights, 0.0), wg, wu, wd)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
