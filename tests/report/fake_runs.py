"""Synthetic run directories with the observability contract's keys (obs_contract: the
metrics.jsonl / events.jsonl names), for the report's tests and its scale measurement."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CONFIG = "model:\n  num_layers: 4\n  num_dense_layers: 1\n  mtp_depth: 0\nmoe:\n  num_experts: 8\n"


def record(step: int, rng, moe_layers: int, experts: int, dead: dict[int, list[int]],
           skipped: bool = False) -> dict:
    """One metrics.jsonl record of the contract (per-layer arrays included)."""
    load = rng.dirichlet(np.ones(experts), size=moe_layers)
    for layer, ids in dead.items():
        load[layer, ids] = 0.0
    load /= load.sum(axis=1, keepdims=True)
    layers = moe_layers + 1  # one dense layer first
    return {"step": step, "loss": 7.0 * np.exp(-step / 50) + 3.0, "ce_loss": 7.0,
            "grad_norm": None if skipped else 1.0 + 0.1 * rng.random(),
            "learning_rate": 1e-3 * min(1.0, step / 10), "loss_scale": 2.0**15,
            "tokens_per_second": 1000.0 + rng.random(), "mfu": 0.3, "skipped": float(skipped),
            "expert_load_fraction": load.tolist(),
            "router_entropy": rng.random(moe_layers).tolist(),
            "activation_rms_by_layer": rng.random(layers).tolist(),
            "update_ratio_by_layer": rng.random(layers).tolist(),
            "grad_norm_by_group": {"attention": rng.random(layers).tolist(), "embedding": 0.5},
            "dead_experts": {str(layer): ids for layer, ids in dead.items()},
            "dead_expert_count": sum(len(ids) for ids in dead.values())}


def write_run(path: Path, *, steps: int = 40, every: int = 2, moe_layers: int = 3,
              experts: int = 8, dead: dict[int, list[int]] | None = None, skip_step: int = 20,
              eval_every: int = 10, truncate: bool = False, events: bool = True) -> Path:
    """A run dir with metrics.jsonl (logged every `every` steps; the update of `skip_step`
    skipped), events.jsonl, config.yaml and plan.json; `truncate` cuts the last record in half
    (a killed run). Returns `path`."""
    rng = np.random.default_rng(0)
    dead = {1: [5]} if dead is None else dead
    path.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(every, steps + 1, every):
        rec = record(step, rng, moe_layers, experts, dead, skipped=step == skip_step)
        if step % eval_every == 0:
            rec["eval_loss"] = rec["loss"] + 0.2
        lines.append(json.dumps(rec))
    text = "\n".join(lines) + "\n"
    if truncate:
        text = text[:len(text) - len(lines[-1]) // 2 - 1]  # half the last line, no newline
    (path / "metrics.jsonl").write_text(text)
    if events:
        (path / "events.jsonl").write_text(
            json.dumps({"step": skip_step, "kind": "skip", "message": "update skipped: nonfinite"})
            + "\n" + json.dumps({"step": 30, "kind": "dead_experts",
                                 "message": "layer 1: experts [5] dead"}) + "\n")
    (path / "config.yaml").write_text(CONFIG)
    (path / "plan.json").write_text(json.dumps({
        "cluster": "8xcpu", "mesh": {"data": 2, "fsdp": 2, "expert": 2}, "devices": 8,
        "peak_bytes_per_device": 2**25, "usable_bytes_per_device": 2**31, "fits": True,
        "memory_by_part": {"parameters": 2**21, "temporaries": 2**24},
        "step_time_parts_s": {"compute": 0.2, "ici": 0.01},
        "collective_bytes_per_step": {"data": {"all-reduce": {"ici": 2**22, "dcn": 0.0}}},
        "step_time_s": 0.21, "tokens_per_second": 8000.0, "mfu": 0.4}))
    return path
