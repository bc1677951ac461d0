"""The residual stream stays in precision.compute_dtype through the layer scans.

Checked on the jaxpr of the gradient (no compile): every scan carry and every stacked scan
output shaped like the residual ([B, S, D], or [L, B, S, D] for the residuals a remat policy
saves per layer) has the compute dtype. Norms, softmax and the router compute in float32
inside the blocks (precision policy), but nothing float32 of the residual's size crosses a
layer boundary.

(The float32 [L, B, S, D] buffer that `maxmoe plan` listed for bfloat16 runs is XLA:CPU's,
not the model's: its bfloat16 normalisation upcasts dynamic-slice, and while-loop invariant
code motion then hoists a convert of the whole saved stack out of the backward loop. XLA:GPU's
deviceless compile of the same step keeps the stack bfloat16;
docs/performance/precision-and-fp8.md.)
"""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxmoe.config_files import load_config
from maxmoe.model.transformer import build_model

B, S = 2, 16


def scans(jaxpr):
    """Every scan equation in jaxpr and the jaxprs nested in it (remat, pjit, custom_vjp)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from scans(sub)


def residual_avals(eqn, hidden: int):
    """The scan's carries and stacked outputs shaped like the residual stream."""
    n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    carry = [v.aval for v in eqn.invars[n_consts:n_consts + n_carry]]
    stacked = [v.aval for v in eqn.outvars[n_carry:]]
    return ([a for a in carry if a.shape == (B, S, hidden)],
            [a for a in stacked if a.shape[1:] == (B, S, hidden)])


@pytest.mark.parametrize("remat", ["full", "none"])
def test_layer_scans_carry_the_compute_dtype(remat):
    cfg, _ = load_config(["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml"],
                         ["precision.compute_dtype=bfloat16", f"model.remat_policy={remat}"])
    graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(cfg)))  # shapes only
    zeros = jnp.zeros((B, S), jnp.int32)
    batch = {"tokens": zeros, "targets": zeros, "segment_ids": zeros + 1,
             "positions": jnp.broadcast_to(jnp.arange(S), (B, S)),
             "loss_mask": jnp.ones((B, S), jnp.float32)}
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: nnx.merge(graphdef, p).loss(batch)[0]))(params)
    carries, stacks = [], []
    for eqn in scans(jaxpr.jaxpr):
        c, s = residual_avals(eqn, cfg.model.hidden_size)
        carries += c
        stacks += s
    # forward and backward scans of the dense and the MoE group
    assert len(carries) >= 4
    assert {a.dtype for a in carries} == {np.dtype(jnp.bfloat16)}, carries
    if remat == "full":
        # the inputs each layer's recompute starts from: one per scanned layer group
        assert stacks and {a.dtype for a in stacks} == {np.dtype(jnp.bfloat16)}, stacks
