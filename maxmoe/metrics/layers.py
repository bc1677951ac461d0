"""The per-layer part of a metrics.jsonl record (docs/observability.md): the arrays a logged step
writes, from the step's metrics on the host, as JSON-ready nested lists (non-finite values
as None).

Rows: [L] arrays are the decoder layers in order, then the MTP blocks; [L_moe] / [L_moe, E]
arrays the MoE layers in order, then MTP's MoE (model.spec.moe_layer_indices).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from maxmoe.metrics.router_health import dead_experts, load_stats

# written as the step gives them, when it does: [L_moe], [L_moe, E], [L], {group: [n] | scalar}
STEP_ARRAYS = ("router_entropy", "router_bias", "dropped_fraction_by_layer",
               "activation_rms_by_layer", "update_ratio_by_layer", "grad_norm_by_group")


def _finite_or_none(v):
    if isinstance(v, list):
        return [_finite_or_none(x) for x in v]
    return v if math.isfinite(v) else None


def json_array(x) -> list | float | None:
    """An array (or scalar) as nested lists of Python floats, non-finite entries None."""
    return _finite_or_none(np.asarray(x, np.float64).tolist())


def _all_nan(value) -> bool:
    values = value.values() if isinstance(value, dict) else [value]
    return all(np.isnan(np.asarray(v, np.float64)).all() for v in values)


def layer_record(host: dict, *, per_layer: bool, dead_windows: int, layers: list[int],
                 logged_only: Iterable[str] = ()) -> dict:
    """The record entries of one logged step from its host metrics:

    - dead_experts {layer: [expert ids]} and dead_expert_count, from the device's zero-load
      window counters (router_health.update_window), when the model has MoE layers;
    - with per_layer: expert_load_fraction [L_moe, E] (rows sum to 1), load_max_mean_ratio
      and load_cv [L_moe] from this step's expert_load, and STEP_ARRAYS as the step gives them.

    logged_only: keys the step computes only on logged steps (NaN elsewhere): left out when
    all NaN (a step cut short by SIGTERM), not written as nulls."""
    out: dict = {}
    if "expert_zero_windows" in host:
        dead = dead_experts(host["expert_zero_windows"], dead_windows, layers)
        out.update(dead_experts=dead, dead_expert_count=sum(map(len, dead.values())))
    if not per_layer:
        return out
    if "expert_load" in host:
        load = np.asarray(host["expert_load"], np.float64)
        out["expert_load_fraction"] = json_array(
            load / np.maximum(load.sum(axis=-1, keepdims=True), 1e-30))
        out.update({k: json_array(v) for k, v in load_stats(load).items()})
    logged_only = set(logged_only)
    for key in STEP_ARRAYS:
        value = host.get(key)
        if value is None or (key in logged_only and _all_nan(value)):
            continue
        out[key] = ({group: json_array(v) for group, v in value.items()}
                    if isinstance(value, dict) else json_array(value))
    return out
