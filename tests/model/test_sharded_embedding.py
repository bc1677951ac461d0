"""The embedding lookup keeps its [V, D] table split (model/layers.py, sharded_lookup).

Reference: jnp.take on one device, float32; forward and table gradient (of a weighted sum of
the outputs, repeated ids included so the scatter-add sums) within rtol 1e-6, atol 1e-6: only
the order of float32 adds differs. Meshes: vocab over tensor and embed over fsdp (the default
rules), vocab over an axis that also splits the batch, and the tokens replicated over the
table's axes. And the compiled step holds no whole [V, D] buffer: the largest temporary of
the lookup's forward + backward is below the table's size.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.config import DEFAULT_RULES
from maxmoe.model.layers import sharded_lookup
from maxmoe.sharding import make_mesh, named, use_mesh

V, D, B, S = 64, 32, 8, 16
LAYOUTS = {
    "data2 fsdp2 tensor2": (dict(data=2, fsdp=2, pipeline=1, expert=1, tensor=2), DEFAULT_RULES),
    "vocab over fsdp (a batch axis)": (dict(data=2, fsdp=2, pipeline=1, expert=2, tensor=1),
                                      dict(DEFAULT_RULES, vocab=["fsdp"], embed=["expert"])),
    "tokens replicated": (dict(data=1, fsdp=2, pipeline=1, expert=1, tensor=4),
                          dict(DEFAULT_RULES, batch=[])),
}


def _loss(table, tokens, probe):
    return jnp.sum(sharded_lookup(table, tokens, jnp.float32) * probe)


def _inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    table = jax.random.normal(keys[0], (V, D))
    tokens = jax.random.randint(keys[1], (B, S), 0, V).at[:, :4].set(7)  # repeats
    return table, tokens, jax.random.normal(keys[2], (B, S, D))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_lookup_equals_take(layout):
    table, tokens, probe = _inputs()
    ref = jax.jit(jax.value_and_grad(_loss))(table, tokens, probe)
    sizes, rules = LAYOUTS[layout]
    with use_mesh(make_mesh(sizes), rules):
        args = (jax.device_put(table, named(("vocab", "embed"))),
                jax.device_put(tokens, named(("batch", "seq"))),
                jax.device_put(probe, named(("batch", "seq", None))))
        got = jax.jit(jax.value_and_grad(_loss))(*args)
        x = jax.jit(functools.partial(sharded_lookup, dtype=jnp.float32))(*args[:2])
    np.testing.assert_allclose(x, jnp.take(table, tokens, axis=0), rtol=0, atol=0)
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-6, atol=1e-6)


def _gspmd_lookup(table, tokens, probe):
    """The previous Embed: a take from the table constrained vocab-replicated."""
    whole = jax.lax.with_sharding_constraint(table, named((None, "act_embed")))
    return jnp.sum(jnp.take(whole, tokens, axis=0) * probe)


def test_no_whole_table_buffer():
    """Temporaries of forward + backward, V 8192 (a 1 MiB float32 table) against 128 tokens:
    the previous lookup's held the whole table (its gradient), this one's its own quarter
    (tensor 2 x fsdp 2)."""
    v = 8192
    table, tokens, probe = _inputs()
    table = jnp.tile(table, (v // V, 1))
    sizes, rules = LAYOUTS["data2 fsdp2 tensor2"]
    temps = {}
    with use_mesh(make_mesh(sizes), rules):
        args = (jax.device_put(table, named(("vocab", "embed"))),
                jax.device_put(tokens, named(("batch", "seq"))),
                jax.device_put(probe, named(("batch", "seq", None))))
        for name, loss in (("sharded", _loss), ("gspmd", _gspmd_lookup)):
            compiled = jax.jit(jax.grad(loss)).lower(*args).compile()
            temps[name] = compiled.memory_analysis().temp_size_in_bytes
    # sharded: its [V / 2, D / 2] float32 gradient block plus token-sized buffers (< 32 KiB)
    assert temps["gspmd"] >= v * D * 4 and temps["sharded"] <= v * D + 32 * 1024, temps
