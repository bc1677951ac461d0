"""Routing under a mesh: the same choices as one device, computed where the tokens are.

XLA's SPMD partitioner does not split a sort by batch, so a plain `lax.top_k` on batch-sharded
router scores gathered the global batch onto every device (at 671B on 2048 devices among the
plan's largest buffers: docs/performance/gpu.md). `router.local_top_k` keeps it per batch
shard."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from maxmoe.config import MoEConfig
from maxmoe.model.router import route
from maxmoe.sharding import make_mesh, use_mesh

SIGMOID_GROUPS = MoEConfig(num_experts=16, experts_per_token=4, router="sigmoid", num_groups=4,
                           groups_per_token=2, routed_scaling_factor=2.5)
SOFTMAX = MoEConfig(num_experts=16, experts_per_token=2)


@pytest.mark.parametrize("cfg", [SIGMOID_GROUPS, SOFTMAX], ids=["sigmoid_groups", "softmax"])
def test_route_on_a_mesh_equals_one_device_and_never_gathers_the_batch(cfg):
    rng = np.random.default_rng(0)
    b, s, e = 16, 32, cfg.num_experts
    logits = rng.normal(size=(b, s, e)).astype(np.float32)
    bias = rng.normal(scale=0.1, size=(e,)).astype(np.float32) if cfg.router == "sigmoid" else None
    want = jax.jit(lambda x: route(x, cfg, bias)[:2])(logits)

    sizes = {"data": 2, "fsdp": 2, "pipeline": 1, "expert": 2, "tensor": 1}
    mesh = make_mesh(sizes, jax.devices()[:8])
    rules = {"batch": ["data", "fsdp", "expert"]}
    with use_mesh(mesh, rules):
        x = jax.device_put(logits, NamedSharding(mesh, P(("data", "fsdp", "expert"))))
        f = jax.jit(lambda x: route(x, cfg, bias)[:2])
        got = f(x)
        hlo = f.lower(x).compile().as_text()
    np.testing.assert_array_equal(got[0], want[0])  # the same experts, exactly
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)  # float32 weights
    # no collective moves the batch's scores: every all-gather result is smaller than one
    # device's share of the scores times the batch shards
    gathers = re.findall(r"= f32\[([\d,]+)\][^\n]*all-gather\(", hlo)
    assert all(int(dims.split(",")[0]) < b for dims in gathers), gathers
