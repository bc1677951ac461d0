"""The pipeline's weight regrouping: each chunk sent once, no replication by the compiler.

XLA's SPMD partitioner, asked for a sharding it cannot reach efficiently, replicates the tensor
and partitions it again, and says so only in its log ("Involuntary full rematerialization");
the numbers stay right, so equivalence tests cannot see it. At 671B such a replication is a
whole layer stack on every device. The compile test reads the compiler's log instead.
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxmoe.model.block import run_layers
from maxmoe.parallel import pipeline
from maxmoe.parallel.pipeline import _natural_aux, run_pipeline
from maxmoe.parallel.pipeline_loop import _aux_add
from maxmoe.parallel.schedule import PipelineSchedule
from maxmoe.parallel.stage_weights import _stage_slots, slot_permutes
from maxmoe.sharding import current_mesh, make_mesh, stack_source_spec, use_mesh
from maxmoe.validation import validate
from tests.helpers import small_config

ROOT = Path(__file__).resolve().parents[2]
WARNING = "Involuntary full rematerialization"

# compiles the real train step of configs/mesh/cpu8_pipeline.yaml (tiny DeepSeek-V3: MLA, MTP,
# sigmoid group-limited routing) once per override list (argv: lists separated by "--") and
# prints each one's temporary bytes per device after it
COMPILE = """
import sys
from maxmoe.bench import memory_analysis
from maxmoe.config_files import load_config
from maxmoe.plan.probe import abstract_batch
from maxmoe.sharding import make_mesh, use_mesh
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate

groups = [[]]
for arg in sys.argv[1:]:
    if arg == "--":
        groups.append([])
    else:
        groups[-1].append(arg)
for overrides in groups:
    cfg, origins = load_config(["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml",
                                "configs/mesh/cpu8_pipeline.yaml"], overrides)
    trainer = make_trainer(cfg, make_mesh(validate(cfg, 8, origins)))
    with use_mesh(trainer.mesh, trainer.rules):
        compiled = trainer.jitted_step.lower(trainer.abstract_state,
                                             abstract_batch(cfg, trainer.batch_sharding)).compile()
    print("compiled", memory_analysis(compiled)["temp_bytes"], file=sys.stderr, flush=True)
"""
# 2 stages x 2 expert x 2 fsdp, circular, at a smaller shape
SMALL = ["data.seq_len=32", "data.global_batch_size=8", "model.vocab_size=256"]
# 4 unequal stages x fsdp 2 (6 MoE layers: chunks 1, 1, 2, 2; the layer dim, which 4 does not
# divide, whole on every stage), where the head and loss dominate: a 16384-token vocabulary,
# no lm_loss_chunk (logits f32 [16, 64, 16384], 64 MiB whole), tiny pipelined layers
OUTER_HEAVY = ["mesh.pipeline=4", "mesh.fsdp=2", "mesh.expert=1", "mesh.data=1",
               "model.num_layers=7", "model.pipeline_schedule=gpipe", "model.vocab_size=16384",
               "data.seq_len=64", "data.global_batch_size=16", "model.remat_policy=full"]
OLD_RULES = ["mesh.rules.batch=[data, fsdp, expert]"]  # the stage axis not among the batch's
COMPILES = {"circular": SMALL, "outer_heavy": OUTER_HEAVY,
            "outer_heavy_old_rules": [*OUTER_HEAVY, *OLD_RULES]}


def _table(stages, repeats, layers, split=()):
    return PipelineSchedule("circular" if repeats > 1 else "gpipe", stages, repeats, stages,
                            tuple(split)).slot_table(layers)


@pytest.mark.parametrize("stages, repeats, layers, split", [
    (2, 2, 4, ()), (4, 2, 16, ()), (2, 4, 16, ()), (4, 3, 24, ()), (8, 2, 32, ()),
    (4, 1, 12, (2, 4, 3, 3)), (2, 2, 6, (1, 2, 2, 1)), (4, 2, 16, (3, 1, 2, 2, 2, 2, 2, 2))])
def test_slot_permutes_deliver_every_layer_once(stages, repeats, layers, split):
    """Simulated on plain lists: every real slot of the table receives its layer once, from
    the stage that stores it; each permute pairs distinct sources with distinct targets."""
    table = _table(stages, repeats, layers, split)
    block = layers // stages
    got = {}
    for r, slot, n, pairs in slot_permutes(table, block):
        assert len({q for q, _ in pairs}) == len({p for _, p in pairs}) == len(pairs)
        for q, p in pairs:
            for i in range(n):
                assert (p, slot + i) not in got
                got[p, slot + i] = q * block + r + i  # the layer q stores at row r + i
    assert got == {(p, s): layer for p, row in enumerate(table) for s, layer in enumerate(row)
                   if layer >= 0}


def test_equal_circular_chunks_move_as_whole_chunks():
    """4 stages x 2 repeats of 2-layer chunks: each permute moves a whole chunk, V^2 at most."""
    moves = slot_permutes(_table(4, 2, 16), 4)
    assert {n for *_, n, _ in moves} == {2} and len(moves) <= 4


def test_pipeline_aux_maxes_dispatch_rounds_and_averages_the_rest():
    """2 stages x 1 layer, 2 microbatches through the schedule's 3 iterations (stage p runs
    microbatch t - p): dispatch_rounds per layer is the max over microbatches, dropped_fraction
    the mean. Layer 0 ran 1 then 3 rounds, layer 1 ran 2 then 1."""
    table, m = _table(2, 1, 2), 2
    rounds = {0: [1.0, 3.0], 1: [2.0, 1.0]}  # layer (= stage) -> rounds per microbatch
    acc = {k: jnp.zeros((2, 1, 1)) for k in ("dispatch_rounds", "dropped_fraction")}
    for t in range(3):
        micro = [t - p for p in range(2)]
        weight = jnp.array([[1.0 if 0 <= i < m else 0.0] for i in micro])  # [P, V]
        value = jnp.array([[rounds[p][i] if 0 <= i < m else 7.0] for p, i in enumerate(micro)])
        acc = {k: _aux_add(k, a, weight, value) for k, a in acc.items()}
    out = _natural_aux(acc, table, m)
    np.testing.assert_array_equal(out["dispatch_rounds"], [3.0, 2.0])
    np.testing.assert_allclose(out["dropped_fraction"], [2.0, 1.5])


@pytest.mark.parametrize("stages, layers, split, rules, by_rules", [
    (2, 8, (), [], False), (4, 16, (), [], False), (4, 16, (3, 1, 2, 2, 2, 2, 2, 2), [], False),
    (4, 10, (), [], False), (4, 10, (), [], True),
    (4, 10, (), ["mesh.rules.embed=[fsdp,pipeline]"], False)])
def test_stage_slots_on_a_mesh_equal_the_local_gather(stages, layers, split, rules, by_rules):
    """The shard_map against a plain gather of the table on one device, and its gradient
    against the scatter back; exact, it only moves values. Cases: the layer dim split over the
    stages (collective permutes); 10 layers on 4 stages: `embed` split over fsdp x pipeline (an
    all-to-all), where the state stores the stage axis or the rules put it, or the layer dim
    whole on every stage (a local pick) for a variable stored by the rules alone."""
    cfg, origins = small_config(f"mesh.pipeline={stages}", "mesh.fsdp=2",
                                f"mesh.data={8 // stages // 2}", f"model.num_layers={1 + layers}",
                                *rules)
    table = _table(stages, 2, layers, split)
    flat = np.asarray(table).reshape(-1)
    a = jnp.arange(layers * 8 * 3, dtype=jnp.float32).reshape(layers, 8, 3) + 1
    want = np.where(flat[:, None, None] >= 0, np.asarray(a)[np.maximum(flat, 0)], 0)
    seed = np.random.default_rng(0).normal(size=want.shape).astype(np.float32)
    want_grad = np.zeros(a.shape, np.float32)
    np.add.at(want_grad, flat[flat >= 0], seed[flat >= 0])
    var = nnx.Param(a, axes=("embed", None), store_by_rules=by_rules)  # stacked: + "layers"
    with use_mesh(make_mesh(validate(cfg, 8, origins)), cfg.mesh.rules):
        source = stack_source_spec(var)
        split_over_stages = "pipeline" in jax.tree.leaves(tuple(source))
        assert split_over_stages == (layers % stages == 0 or not by_rules), source
        a = jax.device_put(a, jax.sharding.NamedSharding(current_mesh(), source))
        got = jax.jit(lambda x: _stage_slots(x, source, table))(a)
        grad = jax.jit(jax.grad(lambda x: jnp.sum(_stage_slots(x, source, table) * seed)))(a)
    np.testing.assert_array_equal(np.asarray(got), want)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-6)


@pytest.fixture(scope="module")
def compiles() -> dict[str, tuple[int, list[str]]]:
    """{name in COMPILES: (temporary bytes per device of its train step, the compiler's
    replication warnings while compiling it)}: one subprocess, no compilation cache (a cache
    hit would skip the partitioner's log), so each layout compiles once for every test here."""
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    argv = [arg for overrides in COMPILES.values() for arg in ["--", *overrides]][1:]
    run = subprocess.run([sys.executable, "-c", COMPILE, *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    out, warnings = {}, []
    for line in run.stderr.splitlines():
        if WARNING in line:
            warnings.append(line)
        elif line.startswith("compiled "):
            out[list(COMPILES)[len(out)]] = int(line.split()[1]), warnings
            warnings = []
    assert list(out) == list(COMPILES), run.stderr[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["circular", "outer_heavy"])
def test_pipelined_step_compiles_without_replication(compiles, name):
    lines = compiles[name][1]
    assert not lines, f"{len(lines)} replications, first: {lines[0][:600]}"


class _Toy(nnx.Module):
    """A residual layer h + tanh(h w) in h's dtype, the run_layers calling convention."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(0.3 * jax.random.normal(rngs.params(), (8, 8)), axes=("embed", None))

    def __call__(self, h, segment_ids, positions):
        return h + jnp.tanh(h @ self.w[...].astype(h.dtype)), {}


@pytest.mark.parametrize("kind, repeats, layers", [("gpipe", 1, 4), ("circular", 2, 6)])
def test_packed_stage_inputs_change_no_bit(monkeypatch, kind, repeats, layers):
    """bf16 stage inputs are saved as float32 words of their bytes (`stage_words.pack`) and
    the output leaves stage 0 as int32 words (`stage_words.stage_zero`): the pipelined output
    and gradients equal, bit for bit, those of the same schedule keeping them as bf16;
    and the unpipelined stack's within bf16 rounding (rtol 0.05: bf16 at 8 bits of mantissa,
    through 4-6 layers)."""
    stack = nnx.vmap(lambda r: _Toy(r), in_axes=0)(nnx.Rngs(0).fork(split=layers))
    schedule = PipelineSchedule(kind, 2, repeats, 4)
    x = jax.random.normal(jax.random.key(1), (8, 4, 8)).astype(jnp.bfloat16)
    ids = jnp.zeros((8, 4), jnp.int32)
    run = functools.partial(run_layers, remat="full")

    def loss(state, x, piped=True):
        model = nnx.merge(nnx.graphdef(stack), state)
        if not piped:
            return jnp.sum(run(*nnx.split(model), x, ids, ids)[0].astype(jnp.float32) ** 2)
        y, _ = run_pipeline(model, x, ids, ids, run_layers=run, schedule=schedule)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    state = nnx.state(stack)
    packed = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)
    reference = jax.jit(jax.value_and_grad(functools.partial(loss, piped=False),
                                           argnums=(0, 1)))(state, x)
    monkeypatch.setattr(pipeline, "packs", lambda x: False)
    plain = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)
    for a, b, c in zip(jax.tree.leaves(packed), jax.tree.leaves(plain),
                       jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32),
                                   rtol=0.05, atol=0.05)


class _ToyAux(_Toy):
    """_Toy with a summed aux value that the loss reads (as the MoE balance losses do) and a
    metric (activation_rms, a sqrt: its derivative at a zero row is infinite)."""

    def __call__(self, h, segment_ids, positions):
        h, _ = super().__call__(h, segment_ids, positions)
        return h, {"z_loss": jnp.mean(h ** 2),
                   "activation_rms": jnp.sqrt(jnp.mean(jnp.square(h)))}


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("kind, stages, repeats, micro, layers", [
    ("gpipe", 2, 1, 4, 6),  # 3 slots a stage
    ("circular", 2, 2, 4, 10),  # chunks 2, 2, 3, 3: padding slots
    ("gpipe", 2, 1, 1, 4),  # M < P: stage 0 reads and writes io's one row in one iteration
    ("circular", 4, 2, 4, 8)])  # 1 slot: nothing to run ahead
def test_pipeline_backward_equals_the_unpipelined_gradient(kind, stages, repeats, micro, layers,
                                                           ahead):
    """The pipeline loop's own backward (`pipeline_loop.Loop`: each iteration's slots re-run one
    backward iteration ahead, or without `ahead` one vjp of the stage's pass) gives the
    gradients of the unpipelined layer scan, for the params, the input and through an aux
    value: float32, rtol 1e-5 and atol 1e-6 of the leaf's largest value (summation order
    differs: microbatches; the reference: the same layers in one scan, autodiff)."""
    stack = nnx.vmap(lambda r: _ToyAux(r), in_axes=0)(nnx.Rngs(0).fork(split=layers))
    schedule = PipelineSchedule(kind, stages, repeats, micro)
    x = jax.random.normal(jax.random.key(1), (8, 4, 8))
    ids = jnp.zeros((8, 4), jnp.int32)
    run = functools.partial(run_layers, remat="full")

    def loss(state, x, piped=True):
        model = nnx.merge(nnx.graphdef(stack), state)
        if piped:
            y, aux = run_pipeline(model, x, ids, ids, run_layers=run, schedule=schedule,
                                  ahead=ahead)
        else:
            y, aux = run(*nnx.split(model), x, ids, ids)
        return jnp.sum(y ** 2) + 3.0 * jnp.sum(aux["z_loss"])

    state = nnx.state(stack)
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)
    want = jax.jit(jax.value_and_grad(functools.partial(loss, piped=False), argnums=(0, 1)))(
        state, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                   atol=1e-6 * np.abs(np.asarray(b)).max())


@pytest.mark.slow
def test_outside_work_is_split_over_the_stages(compiles):
    """Issue 25 item 3 (tests/parallel/test_pipeline_outer.py): the compiled train step's
    temporaries with the stage axis among the batch axes against the old rules (every stage
    ran the whole batch's head, loss and MTP), on 4 stages. Property: new < 0.7 x old. Splitting
    the outside work over the stages divides the head / loss buffers by 4 but not the
    pipeline's own, so the split layout lands well under 0.7; without the stage axis among the
    batch axes both compiles are the same (ratio 1.0) and the test fails. Measured ratios:
    docs/performance/parallelism.md, "Pipeline memory at scale"."""
    new, old = compiles["outer_heavy"][0], compiles["outer_heavy_old_rules"][0]
    print(f"temporaries {new} / {old} bytes = {new / old:.3f}")
    assert new < 0.7 * old, (new / old, new, old)
