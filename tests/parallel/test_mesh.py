"""Hybrid (ICI x DCN) meshes keep the fast axes inside a host, and compute the same numbers."""

import jax
import numpy as np
import pytest

from maxmoe.config import ConfigError
from maxmoe.sharding import make_mesh
from maxmoe.validation import dcn_sizes, validate
from tests.helpers import loss_and_grads, random_batch, small_config


def _host(device, hosts=2, per_host=4):
    return device.id // per_host  # one process: consecutive groups stand in for hosts


def test_dcn_factor_is_the_outer_part_of_each_axis():
    cfg, origins = small_config("mesh.data=2", "mesh.fsdp=2", "mesh.expert=2",
                                "mesh.dcn_data=2")
    sizes = validate(cfg, 8, origins)
    mesh = make_mesh(sizes, dcn=dcn_sizes(cfg))
    grid = mesh.devices.reshape(2, 4)  # data x (fsdp, expert)
    # every fsdp/expert group (ICI axes) lies inside one host; data crosses hosts
    for data_index in range(2):
        assert {_host(d) for d in grid[data_index]} == {data_index}


def test_dcn_inside_an_axis_keeps_ici_neighbours_together():
    cfg, origins = small_config("mesh.data=1", "mesh.fsdp=8", "mesh.dcn_fsdp=2")
    mesh = make_mesh(validate(cfg, 8, origins), dcn=dcn_sizes(cfg))
    hosts = [_host(d) for d in mesh.devices.reshape(-1)]
    assert hosts == [0, 0, 0, 0, 1, 1, 1, 1]


def test_hybrid_mesh_matches_single_device():
    """Reference: one device, float32; loss within 1e-5 relative, gradients rtol 1e-4."""
    cfg, origins = small_config("mesh.fsdp=2", "mesh.expert=2", "mesh.dcn_data=2")
    batch = random_batch(cfg)
    loss, _, grads = loss_and_grads(*small_config(), batch, num_devices=1)
    hybrid_loss, _, hybrid_grads = loss_and_grads(cfg, origins, batch, num_devices=8)
    np.testing.assert_allclose(hybrid_loss, loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(hybrid_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_dcn_must_divide_the_axis_and_match_hosts():
    cfg, origins = small_config("mesh.data=2", "mesh.fsdp=4", "mesh.dcn_fsdp=3")
    with pytest.raises(ConfigError, match="mesh.dcn_fsdp"):
        validate(cfg, 8, origins)
    cfg, origins = small_config("mesh.data=2", "mesh.fsdp=4", "mesh.dcn_data=2")
    with pytest.raises(ConfigError, match="processes"):
        validate(cfg, 8, origins, num_processes=4)
