"""The LM head and its cross-entropy: whole (`lm_head_matmul`, `cross_entropy`), or fused over
chunks of the sequence (`model.lm_loss_chunk`, `chunked_lm_loss`).

Unchunked, a step holds several float32 [B, S, V] arrays at once (logits, their exponentials,
the logit gradient): with DeepSeek-V3's 129K vocabulary that is 2 GiB each per 4096 tokens.
Here the forward pass keeps only each position's log-sum-exp, and the backward pass recomputes
one [B, chunk, V] block of logits at a time (one more LM-head matmul, as MaxText's vocabulary
tiling does) to form its gradient. A block holds every row a device has; model.outer_microbatches
hands this fewer rows at a time (parallel/row_groups.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from maxmoe.sharding import current_mesh, spec


def _chunks(a, chunk: int):
    """[B, S, ...] -> [S / chunk, B, chunk, ...]: the sequence is not sharded, so this moves
    nothing between devices."""
    b, s = a.shape[:2]
    return jnp.moveaxis(a.reshape(b, s // chunk, chunk, *a.shape[2:]), 1, 0)


def _logits(x, w, specs):
    logits = jnp.einsum("bcd,dv->bcv", x, w, preferred_element_type=jnp.float32)
    return _constrained(logits, specs, 0)


def _constrained(a, specs, which: int):
    """a constrained to specs[which] (_specs), as is where there is no mesh."""
    return a if specs is None else jax.lax.with_sharding_constraint(a, specs[which])


def _specs():
    """The specs of the logits ("batch", "seq", "act_vocab") and of the head ("embed",
    "vocab") under the rules where the loss is called: the custom_vjp's backward is traced
    later, outside any rules the caller set (a vmap over replicas: parallel/replicas.py)."""
    if current_mesh() is None:
        return None
    return spec(("batch", "seq", "act_vocab")), spec(("embed", "vocab"))


def _is_target(targets, vocab: int):
    return jnp.arange(vocab, dtype=targets.dtype) == targets[..., None]


def chunked_lm_loss(x, w, targets, mask, chunk: int):
    """Sum over positions of mask x cross-entropy(x @ w, targets), in float32.

    x [B, S, D] (normed final hidden state, compute dtype); w [D, V]; targets [B, S] int;
    mask [B, S] float32; chunk divides S. Equals the unchunked LM head + cross-entropy; no
    [B, S, V] array is formed, forward or backward.
    """
    return _chunked(x, w, targets, mask, chunk, _specs())


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunked(x, w, targets, mask, chunk: int, specs):
    return _forward(x, w, targets, mask, chunk, specs)[0]


def _forward(x, w, targets, mask, chunk, specs):
    def body(total, xs):
        xc, tc, mc = xs
        logits = _logits(xc, w, specs)
        lse = jax.nn.logsumexp(logits, axis=-1)
        target_logit = jnp.sum(jnp.where(_is_target(tc, w.shape[1]), logits, 0.0), axis=-1)
        return total + jnp.sum((lse - target_logit) * mc), lse

    total, lse = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                              (_chunks(x, chunk), _chunks(targets, chunk), _chunks(mask, chunk)))
    return total, lse


def _fwd(x, w, targets, mask, chunk, specs):
    total, lse = _forward(x, w, targets, mask, chunk, specs)
    return total, (x, w, targets, mask, lse)


def _bwd(chunk, specs, res, g):
    x, w, targets, mask, lse = res

    def body(dw, xs):
        xc, tc, mc, lc = xs
        probs = jnp.exp(_logits(xc, w, specs) - lc[..., None])
        dlogits = (probs - _is_target(tc, w.shape[1])) * (mc * g)[..., None]
        dx = jnp.einsum("bcv,dv->bcd", dlogits.astype(w.dtype), w,
                        preferred_element_type=jnp.float32)
        dw = dw + jnp.einsum("bcd,bcv->dv", xc, dlogits.astype(xc.dtype),
                             preferred_element_type=jnp.float32)
        # split like the head itself: the float32 sum is the head's size, not per device
        return _constrained(dw, specs, 1), dx.astype(x.dtype)

    dw, dx = jax.lax.scan(body, _constrained(jnp.zeros(w.shape, jnp.float32), specs, 1),
                          (_chunks(x, chunk), _chunks(targets, chunk), _chunks(mask, chunk), lse))
    dx = jnp.moveaxis(dx, 0, 1).reshape(x.shape)
    return dx, dw.astype(w.dtype), None, None


_chunked.defvjp(_fwd, _bwd)


@jax.custom_vjp
def lm_head_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [B, S, D] @ w [D, V] -> logits [B, S, V] float32.

    The backward computes the weight gradient as x^T (materialised) @ dlogits, a plain
    row-major matmul: left to autodiff, XLA:CPU transposed the [B*S, V] logit gradient and ran
    a slow transposed-operand dot (docs/performance/planning.md, Other ops of the step)."""
    return jnp.einsum("bsd,dv->bsv", x, w, preferred_element_type=jnp.float32)


def _lm_head_fwd(x, w):
    return lm_head_matmul(x, w), (x, w)


def _lm_head_bwd(res, g):
    x, w = res
    dx = jnp.einsum("bsv,dv->bsd", g.astype(w.dtype), w, preferred_element_type=jnp.float32)
    xt = jax.lax.optimization_barrier(x.reshape(-1, x.shape[-1]).T)  # [D, B*S], kept as is
    dw = jnp.dot(xt, g.reshape(-1, g.shape[-1]).astype(x.dtype),
                 preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


lm_head_matmul.defvjp(_lm_head_fwd, _lm_head_bwd)


@jax.named_scope("loss")
def cross_entropy(logits, targets, mask, tokens=None):
    """Summed cross-entropy over mask's tokens / `tokens` (default: mask's own count)."""
    # on [tokens, vocab]: XLA:CPU's loop fusions index a 3-D [B, S, V] array with a broadcast
    # [B, S] row statistic markedly slower (docs/performance/planning.md, Other ops of the step)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return jnp.sum(ce * mask.reshape(-1)) / jnp.maximum(
        jnp.sum(mask) if tokens is None else tokens, 1.0)
