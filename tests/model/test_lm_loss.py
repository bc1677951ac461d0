"""model.lm_loss_chunk: the chunked LM head + cross-entropy (kernels/lm_loss.py) gives the
unchunked loss and gradients.

Reference: the unchunked path (one [B, S, V] float32 logits array, optax's cross-entropy), in
float32. Tolerance: rtol 1e-5 / atol 1e-6 (only the order of float32 sums differs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from maxmoe.config import ConfigError
from maxmoe.kernels.lm_loss import chunked_lm_loss
from maxmoe.validation import validate
from tests.helpers import assert_grads_close, loss_and_grads, random_batch, small_config


def _plain(x, w, targets, mask):
    logits = jnp.einsum("bsd,dv->bsv", x, w)
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * mask)


def test_chunked_loss_and_gradients_equal_the_whole_sequence():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 16, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(8, 40)) * 0.5, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 40, (3, 16)), jnp.int32)
    mask = jnp.asarray(rng.random((3, 16)) > 0.3, jnp.float32)
    want, (want_dx, want_dw) = jax.value_and_grad(_plain, argnums=(0, 1))(x, w, targets, mask)
    for chunk in (4, 16):
        got, (dx, dw) = jax.value_and_grad(chunked_lm_loss, argnums=(0, 1))(
            x, w, targets, mask, chunk)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(want_dx[mask == 0]).max()) == 0.0  # masked positions get no gradient


def test_model_loss_and_gradients_with_chunks():
    """The whole model (with MTP, whose loss uses the head too) on a mesh whose tensor axis
    shards the vocabulary."""
    devices, base = 8, ["model.mtp_depth=1", "mesh.tensor=2", "mesh.fsdp=2"]
    cfg, origins = small_config(*base)
    batch = random_batch(cfg)
    ref_loss, _, ref_grads = loss_and_grads(cfg, origins, batch, num_devices=devices)
    cfg, origins = small_config(*base, "model.lm_loss_chunk=8")
    loss, _, grads = loss_and_grads(cfg, origins, batch, num_devices=devices)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_grads_close(grads, ref_grads)


def test_a_chunk_that_does_not_divide_the_sequence_is_refused():
    cfg, origins = small_config("model.lm_loss_chunk=5")  # seq_len 32
    with pytest.raises(ConfigError, match=r"model.lm_loss_chunk.*divide data.seq_len = 32"):
        validate(cfg, 1, origins)
