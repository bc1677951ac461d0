"""The blocked grouped-matmul kernel and the dispatch's sort against float64 / NumPy
references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.kernels.blocked_mlp import GROUP, block_expert_mlp
from maxmoe.kernels.grouped_matmul import _stable_argsort


def test_block_expert_mlp_values_and_gradients_equal_float64_reference():
    """block_expert_mlp's custom VJP: it gathers each slot's token, weights the expert output
    and scatter-adds it back; slots of blocks past the last bound are never used and get no
    gradient, an expert without blocks gets a zero gradient, a token met by two experts sums
    both, an empty slot (weight 0) adds nothing; expert 0 has more blocks than one loop step
    takes (GROUP at a time, then one by one). Reference: float64 NumPy (SwiGLU written out,
    its derivatives by central differences of the reference); float32 tolerance rtol 1e-4,
    atol 1e-5."""
    rng = np.random.default_rng(0)
    first = 2 * GROUP + 2  # expert 0: two steps of GROUP blocks, then two single ones
    t, n, bs, d, f, e_count, used = 6, first + 3, 4, 3, 2, 3, first + 2
    x = rng.normal(size=(t, d)).astype(np.float32)
    token = rng.integers(0, t, size=(n, bs)).astype(np.int32)
    row_weight = rng.uniform(0.1, 1.0, size=(n, bs)).astype(np.float32)
    row_weight[3, 1] = 0.0  # an empty slot
    wg = rng.normal(size=(e_count, d, f)).astype(np.float32)
    wu = rng.normal(size=(e_count, d, f)).astype(np.float32)
    wd = rng.normal(size=(e_count, f, d)).astype(np.float32)
    g = rng.normal(size=(t, d)).astype(np.float32)
    bounds = jnp.array([0, first, first, used], jnp.int32)  # expert 1 has no blocks
    block_expert = [0] * first + [2, 2]
    out, vjp = jax.vjp(lambda x, rw, *w: block_expert_mlp(x, token, rw, *w, bounds),
                       x, row_weight, wg, wu, wd)
    grads = vjp(g)

    def reference(x, rw, wg, wu, wd):  # float64; loss = sum(out * g)
        out = np.zeros((t, d))
        for i in range(used):
            e = block_expert[i]
            for j in range(bs):
                v = x[token[i, j]]
                gate, up = v @ wg[e], v @ wu[e]
                out[token[i, j]] += rw[i, j] * (gate / (1 + np.exp(-gate)) * up) @ wd[e]
        return out

    args = [a.astype(np.float64) for a in (x, row_weight, wg, wu, wd)]
    np.testing.assert_allclose(out, reference(*args), rtol=1e-4, atol=1e-5)
    g64, eps = g.astype(np.float64), 1e-6
    for k, got in enumerate(grads):
        want = np.zeros_like(args[k])
        for idx in np.ndindex(*args[k].shape):  # central differences of the float64 reference
            hi, lo = [a.copy() for a in args], [a.copy() for a in args]
            hi[k][idx] += eps
            lo[k][idx] -= eps
            want[idx] = np.sum((reference(*hi) - reference(*lo)) * g64) / (2 * eps)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not np.any(np.asarray(grads[1])[used:])  # unused blocks: no weight gradient
    assert not np.any(np.asarray(grads[2])[1]) and not np.any(np.asarray(grads[4])[1])


@pytest.mark.parametrize("num_keys", [9, 2 ** 30])  # the second overflows int32: argsort path
def test_stable_argsort_equals_numpy_stable_argsort(num_keys):
    """The dispatch's single-key sort gives NumPy's stable argsort (ties in index order)."""
    key = np.random.default_rng(0).integers(0, 9, 4099).astype(np.int32)  # many ties
    got = np.asarray(jax.jit(_stable_argsort, static_argnums=1)(jnp.asarray(key), num_keys))
    np.testing.assert_array_equal(got, np.argsort(key, kind="stable"))
