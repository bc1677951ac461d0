"""batched_by_slices: a grouped all_to_all (axis_index_groups) under vmap, as the pipeline runs
it, equals the same collective called on each slice without vmap (exactly: it only moves data).

Two vmaps: a plain one of 3 slices inside the shard_map (the rule calls the collective once per
slice), and the pipeline's (vmap with spmd_axis_name around the shard_map: its body is batched
with one slice per stage). Groups: the devices of equal position on 2 hosts of 4 (TwoLevel's
hop 1) and the 4 devices of one host (hop 2).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxmoe.parallel.grouped import batched_by_slices

ACROSS = ((0, 4), (1, 5), (2, 6), (3, 7))  # hop 1: equal l on 2 hosts of 4
INSIDE = ((0, 1, 2, 3), (4, 5, 6, 7))  # hop 2: one host's devices


def _exchange(groups):
    n = len(groups[0])
    return batched_by_slices(lambda b: jax.lax.all_to_all(
        b.reshape(n, -1, *b.shape[1:]), "expert", 0, 0, tiled=False,
        axis_index_groups=groups).reshape(b.shape))


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


@pytest.mark.parametrize("groups", [ACROSS, INSIDE])
def test_vmapped_grouped_all_to_all_equals_each_slice(groups):
    mesh = _mesh((8,), ("expert",))
    x = jnp.arange(3 * 8 * 4 * 2, dtype=jnp.float32).reshape(3, 8 * 4, 2)  # [slices, rows, 2]
    run = functools.partial(jax.shard_map, mesh=mesh, in_specs=P(None, "expert"),
                            out_specs=P(None, "expert"), check_vma=False)
    batched = jax.jit(run(jax.vmap(_exchange(groups))))(x)
    one = jax.jit(run(lambda s: _exchange(groups)(s[0])[None]))
    expected = np.concatenate([one(x[i:i + 1]) for i in range(3)])
    np.testing.assert_array_equal(batched, expected)
    assert not np.array_equal(batched, x)  # rows really moved


@pytest.mark.parametrize("groups", [((0, 2), (1, 3)), ((0, 1), (2, 3))])
def test_grouped_all_to_all_under_the_pipelines_vmap(groups):
    """vmap(spmd_axis_name="pipeline") around a shard_map over (pipeline 2 x expert 4), as
    parallel/pipeline.py runs the stages: each stage's slice exchanges on its own devices."""
    mesh = _mesh((2, 4), ("pipeline", "expert"))
    x = jnp.arange(2 * 4 * 4 * 2, dtype=jnp.float32).reshape(2, 4 * 4, 2)  # [stages, rows, 2]

    def stage(h):
        return jax.shard_map(_exchange(groups), mesh=mesh, in_specs=P("expert"),
                             out_specs=P("expert"), check_vma=False)(h)
    piped = jax.jit(jax.vmap(stage, spmd_axis_name="pipeline"))(x)
    one = jax.jit(jax.shard_map(lambda s: _exchange(groups)(s[0])[None], mesh=mesh,
                                in_specs=P("pipeline", "expert"),
                                out_specs=P("pipeline", "expert"), check_vma=False))
    np.testing.assert_array_equal(piped, one(x))
    assert not np.array_equal(piped, x)


@pytest.mark.parametrize("groups", [None, ((0, 2), (1, 3))])
def test_ragged_all_to_all_lowers_under_the_pipelines_vmap(groups):
    """The GPU exchange (ragged_all_to_all, whole axis or subgroups) under the pipeline's vmap
    lowers to one ragged-all-to-all per stage slice with constant (unbatched) offsets, as
    parallel/all_to_all.py's move_slots passes them. Lowering only: XLA:CPU cannot compile it."""
    mesh = _mesh((2, 4), ("pipeline", "expert"))
    n = 4 if groups is None else 2
    exchange = batched_by_slices(lambda *a: jax.lax.ragged_all_to_all(
        *a, axis_name="expert", axis_index_groups=groups))

    def body(rows):  # [n cap, 2] with cap 2; everything sent
        offsets = jnp.arange(n, dtype=jnp.int32) * 2
        sizes = jnp.full((n,), 2, jnp.int32)
        return exchange(rows, jnp.zeros_like(rows), offsets, sizes, offsets, sizes)

    def stage(h):
        return jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"),
                             check_vma=False)(h)
    x = jnp.zeros((2, 4 * n * 2, 2))
    text = jax.jit(jax.vmap(stage, spmd_axis_name="pipeline")).lower(x).as_text()
    assert text.count("ragged_all_to_all") == 1
