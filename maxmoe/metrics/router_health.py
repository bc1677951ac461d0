"""Router health: which expert got how much of each MoE layer's tokens, and which got none.

Two halves, like the guards (train/guards.py):

- on the device, in the train state ("router_health"), `update_window` adds every step's
  expert load [L_moe, E] into the logging window's and, when the window closes (a step whose
  metrics the loop writes), counts for each expert the windows in a row it got no token at
  all (`zero_windows`), then starts a new window. The whole window counts, not only the
  logged step, and the counters are checkpointed with the rest of the state;
- on the host, `load_stats`, `dead_experts` and `describe_dead` turn those arrays into the
  record's figures and the guard's messages.

Rows of every [L_moe, ...] array are the MoE layers in model order, then the MTP blocks when
they are MoE (`model.spec.moe_layer_indices` names the model layer of each row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def init_window(rows: int, experts: int) -> dict:
    """The device state of a fresh run: an empty window and no zero-load windows yet."""
    return {"window_load": jnp.zeros((rows, experts), jnp.float32),
            "zero_windows": jnp.zeros((rows, experts), jnp.int32)}


def update_window(state: dict, load: jax.Array, closes: jax.Array) -> tuple[dict, jax.Array]:
    """(state, this step's expert load [L_moe, E], whether the window closes at this step) ->
    (next state, zero_windows [L_moe, E] int32 after the step: for each expert, how many
    closed windows in a row it got no (token, k) slot in).

    Every step's load counts, skipped updates included (the router did route those tokens);
    a rollback restores the window of the checkpoint it goes back to."""
    total = state["window_load"] + load.astype(jnp.float32)
    zero = jnp.where(closes, jnp.where(total == 0, state["zero_windows"] + 1, 0),
                     state["zero_windows"])
    return {"window_load": jnp.where(closes, 0.0, total), "zero_windows": zero}, zero


def load_stats(load: np.ndarray) -> dict[str, np.ndarray]:
    """expert_load [L_moe, E] -> per layer: load_max_mean_ratio (busiest expert over the mean,
    1 when balanced, E / k when every token picks the same k experts) and load_cv (standard
    deviation over mean of the experts' loads, 0 when balanced)."""
    load = np.asarray(load, np.float64)
    mean = np.maximum(load.mean(axis=-1), 1e-30)
    return {"load_max_mean_ratio": load.max(axis=-1) / mean,
            "load_cv": load.std(axis=-1) / mean}


def dead_experts(zero_windows: np.ndarray, windows: int, layers: list[int]
                 ) -> dict[str, list[int]]:
    """{model layer index as a string: sorted ids of its experts with no tokens for at least
    `windows` logging windows in a row}; layers with none are left out. zero_windows
    [L_moe, E] from `update_window`, layers from `moe_layer_indices`."""
    dead = np.asarray(zero_windows) >= windows
    return {str(layers[row]): [int(e) for e in np.flatnonzero(dead[row])]
            for row in range(dead.shape[0]) if dead[row].any()}


def describe_dead(dead: dict[str, list[int]]) -> str:
    """{"3": [1, 5], "7": [0]} -> "layer 3: experts 1, 5; layer 7: expert 0"."""
    return "; ".join(f"layer {layer}: expert{'s' * (len(ids) > 1)} {', '.join(map(str, ids))}"
                     for layer, ids in dead.items())
