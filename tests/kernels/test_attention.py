"""The attention kernel against a float64 reference: masked softmax attention over the whole
square, differentiated by autodiff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.kernels.attention import attention_core, attention_mask


@pytest.mark.parametrize("block_size", [0, 5])
def test_attention_core_values_and_gradients_equal_float64_reference(block_size):
    """attention_core (float32, custom backward that recomputes the probabilities transposed)
    against autodiff of plain masked softmax attention over the whole square in float64.
    atol 1e-5 on values and gradients of magnitude up to ~6 (float32 autodiff of the
    reference lands within 2e-6 of it too). GQA (2 query heads per kv head), Dv != Dh (as
    MLA), 3 documents and padding (segment 0) in a row, blocks of 5 over 12 queries (5 + 5 +
    2: the last is short)."""
    b, kv, g, s, dh, dv = 2, 2, 2, 12, 8, 6
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, kv, g, s, dh))
    k = jax.random.normal(keys[1], (b, kv, s, dh))
    v = jax.random.normal(keys[2], (b, kv, s, dv))
    cot = jax.random.normal(keys[3], (b, kv, g, s, dv))
    segment_ids = jnp.asarray([[1] * 4 + [2] * 5 + [3] * 2 + [0], [1] * 7 + [2] * 5])
    ours, ours_vjp = jax.vjp(lambda q, k, v: attention_core(q, k, v, segment_ids, block_size),
                             q, k, v)
    ours = [ours, *ours_vjp(cot)]

    def reference(q, k, v):
        scores = jnp.einsum("bkgsd,bktd->bkgst", q, k)
        scores = jnp.where(attention_mask(segment_ids), scores, -jnp.inf)
        return jnp.einsum("bkgst,bktd->bkgsd", jax.nn.softmax(scores, axis=-1), v)

    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(a, np.float64)) for a in (q, k, v, cot)]
        ref, ref_vjp = jax.vjp(reference, *wide[:3])
        ref = [np.asarray(a) for a in (ref, *ref_vjp(wide[3]))]
    for got, want in zip(ours, ref, strict=True):
        assert want.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
