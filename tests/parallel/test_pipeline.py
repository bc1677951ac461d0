"""The pipeline's weight regrouping: each chunk sent once, no replication by the compiler.

XLA's SPMD partitioner, asked for a sharding it cannot reach efficiently, replicates the tensor
and partitions it again, and says so only in its log ("Involuntary full rematerialization");
the numbers stay right, so equivalence tests cannot see it. At 671B such a replication is a
whole layer stack on every device. The compile test reads the compiler's log instead.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe.parallel.pipeline import _stage_order, chunk_permutes
from maxmoe.sharding import make_mesh, use_mesh
from maxmoe.validation import validate
from tests.helpers import small_config

ROOT = Path(__file__).resolve().parents[2]
WARNING = "Involuntary full rematerialization"

# compiles the real train step of the README's pipeline example (tiny DeepSeek-V3: MLA, MTP,
# sigmoid group-limited routing; 2 stages x 2 expert x 2 fsdp, circular), at a smaller shape
COMPILE = """
import sys
from maxmoe.config import load_config
from maxmoe.plan.probe import abstract_batch
from maxmoe.sharding import make_mesh, use_mesh
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate

cfg, origins = load_config(["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml",
                            "configs/mesh/cpu8_pipeline.yaml"], sys.argv[1:])
trainer = make_trainer(cfg, make_mesh(validate(cfg, 8, origins)))
with use_mesh(trainer.mesh, trainer.rules):
    trainer.jitted_step.lower(trainer.abstract_state,
                              abstract_batch(cfg, trainer.batch_sharding)).compile()
print("compiled", file=sys.stderr)
"""


@pytest.mark.parametrize("stages, repeats", [(2, 2), (4, 2), (2, 4), (4, 3), (3, 2), (8, 2)])
def test_chunk_permutes_deliver_every_chunk_once(stages, repeats):
    """Simulated on plain lists: stage p, pass v receives exactly chunk v P + p."""
    got = {}
    for u, v, pairs in chunk_permutes(stages, repeats):
        assert len({q for q, _ in pairs}) == len({p for _, p in pairs}) == len(pairs)
        for q, p in pairs:
            assert (p, v) not in got
            got[p, v] = q * repeats + u  # the chunk q stores at local position u
    assert got == {(p, v): v * stages + p for p in range(stages) for v in range(repeats)}


@pytest.mark.parametrize("stages", [2, 4])
def test_stage_order_on_a_mesh_equals_the_local_regrouping(stages):
    """The shard_map of collective permutes (layer dim split over the stages) against the same
    regrouping on one device (reshape + transpose); exact, it only moves values."""
    cfg, origins = small_config(f"mesh.pipeline={stages}", "mesh.fsdp=2",
                                f"mesh.data={8 // stages // 2}", f"model.num_layers={1 + stages}")
    repeats, layers = 2, 2 * 2 * stages
    a = jnp.arange(layers * 4 * 3, dtype=jnp.float32).reshape(layers, 4, 3)
    want = np.asarray(_stage_order(a, ("layers", "embed", None), stages, repeats))
    order = want[:, 0, 0] // 12
    chunk = layers // (stages * repeats)
    assert list(order) == [(v * stages + p) * chunk + j for p in range(stages)
                           for v in range(repeats) for j in range(chunk)]
    with use_mesh(make_mesh(validate(cfg, 8, origins)), cfg.mesh.rules):
        got = jax.jit(lambda x: _stage_order(x, ("layers", "embed", None), stages, repeats))(a)
        grad = jax.jit(jax.grad(lambda x: jnp.sum(
            _stage_order(x, ("layers", "embed", None), stages, repeats) * want)))(a)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(a))  # the inverse permutation


@pytest.mark.slow
def test_pipelined_step_compiles_without_replication():
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a cache hit would skip the partitioner's log
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    run = subprocess.run([sys.executable, "-c", COMPILE, "data.seq_len=32",
                          "data.global_batch_size=8", "model.vocab_size=256"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert "compiled" in run.stderr, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if WARNING in line]
    assert not lines, f"{len(lines)} replications, first: {lines[0][:600]}"
