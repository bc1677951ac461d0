"""What the per-layer metrics add to a step, without timing noise: XLA's cost analysis
(FLOPs, bytes accessed) of the compiled train step with logging.per_layer true and false, the
metric bytes the host copies each step, and the size of one metrics.jsonl record.

python tools/per_layer_cost.py [CONFIG ...] [KEY=VALUE ...]   (default: configs/tiny.yaml)
Every step is a logged step (logging.every_steps=1). Prints one line per setting and a JSON
line. Timings: `maxmoe bench CONFIG logging.every_steps=1 --sweep logging.per_layer=true,false`.
"""

import json
import sys

import jax
import numpy as np

from maxmoe.bench import synthetic_batch
from maxmoe.commands.setup import configure
from maxmoe.metrics.layers import layer_record
from maxmoe.model.spec import moe_layer_indices
from maxmoe.sharding import global_batch, use_mesh
from maxmoe.train.setup import prepare_run
from maxmoe.train.step import DIAGNOSTICS


def cost(items: list[str]) -> dict:
    """Cost analysis, per-step metric bytes and the JSON record size of one setting."""
    cfg, sizes = configure(items)
    trainer = prepare_run(cfg, sizes).trainer
    state, batch = trainer.init(), global_batch(synthetic_batch(cfg), trainer.batch_sharding)
    with use_mesh(trainer.mesh, trainer.rules):
        compiled = trainer.jitted_step.lower(state, batch).compile()
        _, metrics = compiled(state, batch)
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    host = jax.device_get(metrics)
    record = {k: float(v) for k, v in host.items() if not isinstance(v, dict) and np.ndim(v) == 0}
    record.update(layer_record(host, per_layer=cfg.logging.per_layer,
                               dead_windows=cfg.guard.dead_expert_windows,
                               layers=moe_layer_indices(cfg.model), logged_only=DIAGNOSTICS))
    return {"flops": float(analysis.get("flops", 0.0)),
            "bytes_accessed": float(analysis.get("bytes accessed", 0.0)),
            "metric_bytes": sum(np.asarray(x).nbytes for x in jax.tree.leaves(host)),
            "record_bytes": len(json.dumps(record))}


def main() -> None:
    items = sys.argv[1:]
    if not any("=" not in a for a in items):
        items = ["configs/tiny.yaml", *items]
    out = {}
    for on in ("true", "false"):
        out[on] = cost([*items, "logging.every_steps=1", f"logging.per_layer={on}"])
        r = out[on]
        print(f"per_layer={on}: {r['flops']:.4e} FLOPs, {r['bytes_accessed']:.4e} bytes "
              f"accessed, {r['metric_bytes']} metric bytes a step, {r['record_bytes']} bytes "
              "a metrics.jsonl record", file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
