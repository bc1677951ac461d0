"""Dynamic loss scaling for float16 compute, with DeepSpeed's semantics, as pure functions.

The scaler state is a small pytree in the train state (so it is checkpointed with it):

    {"scale": f32 [], "good_steps": i32 [], "hysteresis": i32 []}

- The loss is multiplied by `scale` before differentiation and the gradients divided by it.
- A step whose unscaled gradients are all finite is clean: after `window` clean steps in a row
  the scale doubles (and the hysteresis budget is refilled).
- On an overflow (any non-finite gradient) the update is skipped by the caller, the clean-step
  count restarts, and the hysteresis budget drops by one; only when it is already down to 1 is
  the scale halved (never below `min_scale`). `hysteresis=1` halves on every overflow.
- An overflow while the scale already sits at `min_scale` sets `at_min` (DeepSpeed raises
  "Current loss scale already at minimum"); the loop turns it into an error exit.

With loss scaling off (bfloat16/float32), `make_loss_scaler` returns None and the step skips
non-finite gradients without scaling.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxmoe.config import PrecisionConfig


class LossScaler(NamedTuple):
    initial_scale: float
    window: int
    hysteresis: int
    min_scale: float

    def init(self) -> dict:
        return {"scale": jnp.asarray(self.initial_scale, jnp.float32),
                "good_steps": jnp.zeros((), jnp.int32),
                "hysteresis": jnp.asarray(self.hysteresis, jnp.int32)}

    def scale(self, loss: jax.Array, state: dict) -> jax.Array:
        return loss * state["scale"].astype(loss.dtype)

    def unscale(self, grads, state: dict):
        inverse = 1.0 / state["scale"]
        return jax.tree.map(lambda g: (g * inverse.astype(g.dtype)), grads)

    def update(self, state: dict, finite: jax.Array) -> tuple[dict, jax.Array]:
        """(next state, at_min flag) after a step whose gradients were `finite` (bool [])."""
        scale, good, hyst = state["scale"], state["good_steps"], state["hysteresis"]
        grow = finite & (good + 1 >= self.window)
        clean_scale = jnp.where(grow, scale * 2.0, scale)
        clean_good = jnp.where(grow, 0, good + 1)
        clean_hyst = jnp.where(grow, self.hysteresis, hyst)
        halve = hyst <= 1
        at_min = ~finite & halve & (scale <= self.min_scale)
        overflow_scale = jnp.where(halve, jnp.maximum(scale * 0.5, self.min_scale), scale)
        overflow_hyst = jnp.where(halve, hyst, hyst - 1)
        new = {"scale": jnp.where(finite, clean_scale, overflow_scale).astype(jnp.float32),
               "good_steps": jnp.where(finite, clean_good, 0).astype(jnp.int32),
               "hysteresis": jnp.where(finite, clean_hyst, overflow_hyst).astype(jnp.int32)}
        return new, at_min


def make_loss_scaler(cfg: PrecisionConfig) -> LossScaler | None:
    """The dynamic scaler if the config asks for one (auto = float16 only), else None."""
    dynamic = cfg.loss_scaling == "dynamic" or (
        cfg.loss_scaling == "auto" and cfg.compute_dtype == "float16")
    if not dynamic:
        return None
    return LossScaler(2.0 ** cfg.loss_scale_initial_power, cfg.loss_scale_window,
                      cfg.loss_scale_hysteresis, cfg.loss_scale_min)
