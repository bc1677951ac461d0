"""parallel/vmap_axes.py, the wrapper of jax's internal axis env, against the installed jax: a
vmap with spmd_axis_name shows its name while traced, and with_spmd_axis_names adds names for
its block only (parallel/pipeline_loop.Loop's backward relies on both)."""

import jax
import jax.numpy as jnp

from maxmoe.config import MESH_AXES
from maxmoe.parallel.vmap_axes import spmd_axis_names, with_spmd_axis_names
from maxmoe.sharding import make_mesh, use_mesh


def test_a_vmaps_spmd_axis_name_is_seen_while_traced():
    seen = []

    def f(x):
        seen.append(spmd_axis_names())
        return x
    mesh = make_mesh({a: 8 if a == "data" else 1 for a in MESH_AXES})
    with use_mesh(mesh, {}):
        jax.vmap(f, spmd_axis_name="data")(jnp.ones(8))
    jax.vmap(f)(jnp.ones(8))
    assert seen == [frozenset({"data"}), frozenset()]


def test_with_spmd_axis_names_adds_them_for_its_block():
    assert spmd_axis_names() == frozenset()
    with with_spmd_axis_names(["fsdp", "data"]):
        assert spmd_axis_names() == {"fsdp", "data"}
        with with_spmd_axis_names(["data"]):  # already there: nothing added twice
            assert spmd_axis_names() == {"fsdp", "data"}
    assert spmd_axis_names() == frozenset()
