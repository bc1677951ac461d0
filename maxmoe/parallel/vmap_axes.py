"""The spmd axis names of the vmaps being traced (jax.vmap's spmd_axis_name): maxmoe's one use of
a jax internal, wrapped here alone. jax (0.10 and 0.12) traces a custom VJP's batched backward
without the spmd axis names of the vmaps around it, and a shard_map linearized there gives its
residuals specs over those axes, which the vmap refuses ("vmap spmd_axis_name cannot appear in
shard_map out_specs"): parallel/pipeline_loop.Loop records the names in its forward and
re-adds them in its backward. tests/parallel/test_vmap_axes.py checks this wrapper against the
installed jax.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from jax._src import core as _core  # no public API reads or extends the axis env


def spmd_axis_names() -> frozenset[str]:
    """The spmd axis names of the vmaps the caller is traced under."""
    return frozenset(_core.get_axis_env().spmd_axis_names)


@contextlib.contextmanager
def with_spmd_axis_names(names: Iterable[str]) -> Iterator[None]:
    """Traces the block with `names` among the spmd axis names (those missing added)."""
    missing = tuple(sorted(set(names) - spmd_axis_names()))
    with _core.add_spmd_axis_names(missing):
        yield
