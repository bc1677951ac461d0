"""Collectives that run under the pipeline's `vmap`: over subgroups of a mesh axis
(axis_index_groups), and ragged_all_to_all.

The pipeline runs its stages as one `jax.vmap` (spmd_axis_name: the pipeline mesh axis), and
the MoE layer's `shard_map` inside it is batched too: its body is traced under a vmap of one
element (jax's shard_map batching rule moves the stages into the specs). jax (0.10.2 and
0.12.0.1, `lax/parallel.py`: `_all_to_all_batched_collective`,
`_ragged_all_to_all_batched_collective`) refuses to batch an all_to_all or ragged_all_to_all
that has axis_index_groups ("Please open a feature request!"), even when the vmapped axis is
not one of the collective's: the batch dim is then only an extra array dim, which the groups
do not touch. Its ragged_all_to_all rule also fails on any offsets or sizes operand that is
not batched (`bdim_at_second` asserts a batch dim before it would broadcast one), as a
constant offsets array never is: the all_to_all transport's ragged exchange did not lower under
the pipeline either.

`batched_by_slices(f)` is f with a vmap rule (the public `jax.custom_batching.custom_vmap`)
that calls f once per slice of the batch and stacks the results: under the pipeline that is
one call, so the collective and its HLO are exactly the unbatched ones (same replica groups,
same bytes). Slices of a larger vmap run one collective each, in order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def batched_by_slices(f):
    """f(*arrays) -> array, as a function whose vmap calls f on each batch slice (module
    docstring). The rule calls the wrapped function again, so nested vmaps peel one level at a
    time."""
    @jax.custom_batching.custom_vmap
    def wrapped(*args):
        return f(*args)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        outs = [wrapped(*(a[i] if b else a for a, b in zip(args, in_batched, strict=True)))
                for i in range(axis_size)]
        return jnp.stack(outs), True

    return wrapped
