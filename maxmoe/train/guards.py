"""Training-stability guards: skip bad updates inside the step, decide on the host what next.

Two halves:

- `StepGuard` runs inside the jitted train step (pure, no host round trip). It decides whether
  this step's update is applied: not if the loss or a gradient is non-finite, not if the global
  gradient norm passes `grad_norm_ceiling`, and (spike_action skip/rollback) not if the loss or
  the gradient norm is a spike: a z-score above `spike_zscore` against the last `spike_window`
  applied steps (kept as ring buffers in the train state, so they are checkpointed). Skipped
  steps are counted; skipped steps never enter the spike statistics.
- `Guard` runs on the host and turns each step's flags into an `Action`: continue; skipped
  (logged); rollback (restore the last checkpoint, skip the data batches from there through
  the spike, continue); or stop (`TrainingStopped`, raised by the loop before the bad step is
  saved, so the last good checkpoint stays the newest).

The host half acts one step late: the loop (loop.py) reads step N's flags only after it has
dispatched step N+1, so the host never stalls the device. That is safe because the update of
a bad step N was already dropped inside step N; step N+1, which is running when the decision
comes, is discarded on rollback or stop (never logged, never saved). A step whose state is
saved, evaluated or is the last is observed before that happens, and step N is always
observed before step N+1's checkpoint: no checkpoint holds a state the guard has not seen.

Guard state in the train state: {"skipped_steps", "consecutive_skips", "history_count" i32 [],
"loss_history", "grad_norm_history" f32 [W]}.

Router health (metrics/router_health.py): the step counts, on the device, each expert's
logging windows in a row without a token; `Guard` names the experts dead for
`guard.dead_expert_windows` windows, then warns (once per change of the dead set) or stops
(`guard.router_action`), and warns when a layer's max/mean expert load passes
`guard.load_ratio_warn`. Both also go to events.jsonl (kinds "dead_experts" and "router").
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxmoe.config import GuardConfig
from maxmoe.metrics.events import EventLog
from maxmoe.metrics.progress import say
from maxmoe.metrics.router_health import dead_experts, describe_dead, load_stats

# a plateau has a tiny spread: z-scores use at least 1% of the mean as the standard deviation,
# so noise on a flat curve is not a spike
RELATIVE_STD_FLOOR = 0.01

# scalars the guard reads every step (part of one small device-to-host copy, one step late)
GUARD_METRICS = ("skipped", "nonfinite", "spike", "over_ceiling", "loss_scale_at_min",
                 "consecutive_skips", "skipped_steps", "loss", "grad_norm", "loss_zscore",
                 "grad_norm_zscore", "activation_rms_max", "update_ratio_max", "loss_scale",
                 "load_max_mean_ratio_max")


class TrainingStopped(RuntimeError):
    """A guard stopped the run; the message says why, at which step, and what to change."""


class StepGuard(NamedTuple):
    """The in-step half (see module doc); built once from the config."""
    window: int
    zscore: float
    ceiling: float  # 0 = off
    spikes: bool  # spike detection on (spike_action skip or rollback)

    @classmethod
    def from_config(cls, cfg: GuardConfig) -> StepGuard:
        return cls(cfg.spike_window, cfg.spike_zscore, cfg.grad_norm_ceiling,
                   cfg.spike_action != "none")

    def init(self) -> dict:
        zeros = jnp.zeros((), jnp.int32)
        return {"skipped_steps": zeros, "consecutive_skips": zeros, "history_count": zeros,
                "loss_history": jnp.zeros((self.window,), jnp.float32),
                "grad_norm_history": jnp.zeros((self.window,), jnp.float32)}

    def _zscore(self, history, count, value):
        n = jnp.minimum(count, self.window).astype(jnp.float32)
        valid = jnp.arange(self.window) < count
        mean = jnp.sum(jnp.where(valid, history, 0.0)) / jnp.maximum(n, 1.0)
        var = jnp.sum(jnp.where(valid, jnp.square(history - mean), 0.0)) / jnp.maximum(n, 1.0)
        std = jnp.maximum(jnp.sqrt(var), RELATIVE_STD_FLOOR * jnp.abs(mean) + 1e-12)
        # judged only against a full window: early training moves too fast for statistics
        return jnp.where(count >= self.window, (value - mean) / std, 0.0)

    def check(self, state: dict, loss: jax.Array, grad_norm: jax.Array, finite: jax.Array):
        """-> (apply bool [], next guard state, metrics). loss, grad_norm float32 []."""
        loss, grad_norm = loss.astype(jnp.float32), grad_norm.astype(jnp.float32)
        finite = finite & jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        over = finite & (grad_norm > self.ceiling) if self.ceiling > 0 else jnp.asarray(False)
        count = state["history_count"]
        z_loss = jnp.where(finite, self._zscore(state["loss_history"], count, loss), 0.0)
        z_grad = jnp.where(finite, self._zscore(state["grad_norm_history"], count, grad_norm), 0.0)
        spike = ((z_loss > self.zscore) | (z_grad > self.zscore)) if self.spikes else (
            jnp.asarray(False))
        apply = finite & ~over & ~spike
        slot = count % self.window
        new = {
            "skipped_steps": state["skipped_steps"] + (~apply).astype(jnp.int32),
            "consecutive_skips": jnp.where(apply, 0, state["consecutive_skips"] + 1),
            "history_count": count + apply.astype(jnp.int32),
            "loss_history": jnp.where(apply, state["loss_history"].at[slot].set(loss),
                                      state["loss_history"]),
            "grad_norm_history": jnp.where(
                apply, state["grad_norm_history"].at[slot].set(grad_norm),
                state["grad_norm_history"]),
        }
        metrics = {"skipped": ~apply, "nonfinite": ~finite, "spike": spike, "over_ceiling": over,
                   "loss_zscore": z_loss, "grad_norm_zscore": z_grad,
                   "skipped_steps": new["skipped_steps"],
                   "consecutive_skips": new["consecutive_skips"]}
        return apply, new, metrics


def select(apply: jax.Array, new, old):
    """new where apply else old, leaf by leaf; old is returned bit for bit on a skip."""
    return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)


class Action(enum.Enum):
    CONTINUE = "continue"
    SKIPPED = "skipped"  # the step did not update the model; logged
    ROLLBACK = "rollback"  # restore the last checkpoint and skip the offending batches
    STOP = "stop"  # raise TrainingStopped (the loop must not save this step)


@dataclass
class Decision:
    action: Action
    message: str = ""



@dataclass
class Guard:
    """The host half: `observe(step, metrics)` once per step, in step order -> Decision.

    step is the number of steps taken (the loop's `done`); metrics the step's metric dict
    (host values, or device arrays of which only the GUARD_METRICS scalars and the router's
    [L_moe, E] expert_zero_windows / expert_load are copied). The loop calls it when the next
    step is already running (see the module doc); messages name the observed step, not the
    running one. Every decision other than continue, every rollback, every threshold warning
    and the router health events also go to `events` (events.jsonl) with their kind.
    """
    cfg: GuardConfig
    log: Callable[[str], None] = say
    events: EventLog = field(default_factory=lambda: EventLog(None))
    warn_every: int = 100  # a threshold warning repeats at most once per this many steps
    rollbacks: int = 0
    moe_layers: list[int] = field(default_factory=list)  # model layer of each [L_moe] row
    _last_warning: dict = field(default_factory=dict)
    _dead: dict = field(default_factory=dict)  # the dead experts last reported

    def observe(self, step: int, metrics: dict) -> Decision:
        m = {k: float(v) for k, v in jax.device_get(
            {k: metrics[k] for k in GUARD_METRICS if k in metrics}).items()}
        self._warn(step, m)
        decision = self._decide(step, m, metrics)
        if decision.action is not Action.CONTINUE:
            kind = {Action.STOP: "stop", Action.ROLLBACK: "spike"}.get(
                decision.action, "spike" if m.get("spike") else "skip")
            self.events.emit(step, kind, decision.message)
        return decision

    def _decide(self, step: int, m: dict, metrics: dict) -> Decision:
        cfg = self.cfg
        if m.get("loss_scale_at_min", 0.0):
            return Decision(Action.STOP, (
                f"step {step}: float16 gradients overflowed at the minimum loss scale "
                f"{m.get('loss_scale', float('nan')):g}; the update was skipped and the last "
                "checkpoint is intact; lower precision.loss_scale_min or train in bfloat16"))
        if m.get("over_ceiling", 0.0):
            return Decision(Action.STOP, (
                f"step {step}: global gradient norm {m['grad_norm']:.4g} exceeds "
                f"guard.grad_norm_ceiling={cfg.grad_norm_ceiling:g}; stopped without applying "
                "or saving this step (the last checkpoint is intact); lower "
                "optimizer.learning_rate or raise guard.grad_norm_ceiling"))
        self._warn_load(step, m, metrics)
        router = self._dead_experts(step, metrics)
        if router is not None:
            return router
        if not m.get("skipped", 0.0):
            return Decision(Action.CONTINUE)
        why = ("non-finite loss or gradients" if m.get("nonfinite") else
               f"loss spike (loss {m['loss']:.4g}, z-score {m.get('loss_zscore', 0):.1f}; "
               f"grad norm {m.get('grad_norm', 0):.4g}, z-score "
               f"{m.get('grad_norm_zscore', 0):.1f})")
        consecutive = int(m.get("consecutive_skips", 0))
        if cfg.max_consecutive_skips and consecutive >= cfg.max_consecutive_skips:
            return Decision(Action.STOP, (
                f"step {step}: {consecutive} updates in a row were skipped (last: {why}); "
                "stopping with the last checkpoint intact; check the data and "
                "optimizer.learning_rate, or raise guard.max_consecutive_skips"))
        if m.get("spike") and cfg.spike_action == "rollback":
            if self.rollbacks >= cfg.max_rollbacks:
                return Decision(Action.STOP, (
                    f"step {step}: {why}, but guard.max_rollbacks={cfg.max_rollbacks} rollbacks "
                    "were already made; stopping with the last checkpoint intact"))
            return Decision(Action.ROLLBACK, f"step {step}: {why}")
        scale = f" (loss scale now {m['loss_scale']:g})" if "loss_scale" in m else ""
        return Decision(Action.SKIPPED, f"step {step}: update skipped: {why}{scale}")

    def _warn(self, step: int, m: dict) -> None:
        for key, limit in (("activation_rms_max", self.cfg.activation_rms_warn),
                           ("update_ratio_max", self.cfg.update_ratio_warn)):
            value = m.get(key)
            if value is None or not value > limit:
                continue
            if step - self._last_warning.get(key, -self.warn_every) >= self.warn_every:
                self._last_warning[key] = step
                message = (f"warning: step {step}: {key} = {value:.4g} exceeds {limit:g} "
                           "(per layer on logged steps: metrics.jsonl activation_rms_by_layer, "
                           "update_ratio_by_layer)")
                self.log(message)
                self.events.emit(step, "warning", message)

    def _rows(self, n: int) -> list[int]:
        return self.moe_layers if len(self.moe_layers) == n else list(range(n))

    def _warn_load(self, step: int, m: dict, metrics: dict) -> None:
        """Warns (and a "router" event) when a MoE layer's max/mean expert load passes
        guard.load_ratio_warn, naming the layers and their busiest experts; at most once per
        warn_every steps."""
        limit, value = self.cfg.load_ratio_warn, m.get("load_max_mean_ratio_max")
        if not limit or value is None or not value > limit or "expert_load" not in metrics:
            return
        if step - self._last_warning.get("load", -self.warn_every) < self.warn_every:
            return
        self._last_warning["load"] = step
        load = np.asarray(jax.device_get(metrics["expert_load"]))
        ratio, layers = load_stats(load)["load_max_mean_ratio"], self._rows(load.shape[0])
        where = "; ".join(f"layer {layers[r]}: {ratio[r]:.3g} (expert {int(np.argmax(load[r]))})"
                          for r in np.flatnonzero(ratio > limit))
        message = (f"step {step}: expert load max/mean exceeds guard.load_ratio_warn={limit:g} "
                   f"in {where}")
        self.log(f"warning: {message}")
        self.events.emit(step, "router", message)

    def _dead_experts(self, step: int, metrics: dict) -> Decision | None:
        """STOP naming the dead experts (guard.router_action=stop), or a warning and a
        "dead_experts" event whenever the set of dead experts changes; None otherwise."""
        if "expert_zero_windows" not in metrics:
            return None
        windows = np.asarray(jax.device_get(metrics["expert_zero_windows"]))
        dead = dead_experts(windows, self.cfg.dead_expert_windows, self._rows(windows.shape[0]))
        if dead == self._dead:
            return None
        self._dead = dead
        if not dead:
            message = f"step {step}: no dead experts any more"
            self.log(message)
            self.events.emit(step, "dead_experts", message)
            return None
        message = (f"step {step}: dead experts (no tokens for guard.dead_expert_windows="
                   f"{self.cfg.dead_expert_windows} logging windows): {describe_dead(dead)}")
        if self.cfg.router_action == "stop":
            message += ("; stopped (guard.router_action=stop) with the last checkpoint intact; "
                        "raise moe.bias_update_speed or moe.aux_loss_weight, or set "
                        "guard.router_action=warn")
            return Decision(Action.STOP, message)  # observe() records it as a "stop" event
        self.log(f"warning: {message}")
        self.events.emit(step, "dead_experts", message)
        return None

    def rollback(self, step: int, checkpointer, abstract_state: Any,
                 data_iterator) -> tuple[Any, int] | None:
        """Restores the newest checkpoint and moves the data past the spike at `step`.

        Returns (state, restored step), or None when there is no checkpoint yet (the spike's
        update was already skipped in the step, so training simply continues). Batches the
        iterator handed out after the spike (to the step that was running when the spike was
        seen) are taken back by restoring its position.
        """
        if checkpointer.latest_step() is None:
            message = (f"step {step}: loss spike but no checkpoint to roll back to yet; "
                       "the update was skipped")
            self.log(message)
            self.events.emit(step, "skip", message)
            return None
        state, restored = checkpointer.restore(abstract_state, data_iterator)
        # the restored iterator is at batch `restored`; batches restored..step-1 fed the steps
        # that led to the spike (the last one is the spike itself): skip them all
        skipped = step - restored + self.cfg.rollback_extra_batches
        for _ in range(skipped):
            next(data_iterator)
        self.rollbacks += 1
        message = (f"rollback {self.rollbacks}: step {step} was a spike; restored step "
                   f"{restored} and skipped {skipped} data batches")
        self.log(message)
        self.events.emit(step, "rollback", message)
        return state, restored

