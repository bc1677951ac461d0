"""The two-level transport (moe.transport=two_level) against one device, and its config rules.

Reference: the same routed_experts on one device (no mesh, `dropless_local`), float32; forward
and gradients within rtol 1e-4, atol 1e-5 (only the order of float32 sums differs). Routing:
group-limited (4 groups of 2 experts, each token in at most 2 groups), random, and the worst
case of hop 2 (every token to experts 0 and 1, both on host 0's device 0 when a device holds
2 experts). One process stands in for H hosts (moe.expert_hosts).

Under the pipeline: the compiled train step's cross-host bytes of the expert all-to-all
against all_to_all's, bounded from the config (the test's docstring derives the bound); its
equivalence with one device is tests/test_sharded_equivalence.py's (two_level under the
pipeline).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxmoe.config import DEFAULT_RULES, ConfigError, MoEConfig
from maxmoe.metrics.flops import pipelined_reruns
from maxmoe.model.spec import layer_groups
from maxmoe.parallel.dispatch import ExpertShards, describe_transport, resolve_transport
from maxmoe.parallel.schedule import pipeline_schedule
from maxmoe.parallel.two_level import TwoLevel
from maxmoe.plan.collectives import collective_bytes
from maxmoe.plan.compiled_flops import matmul_flops
from maxmoe.plan.gpu_aot import gpu_devices, unknown_trip_loops
from maxmoe.plan.prerank import hop1_exchanges, hop1_reruns
from maxmoe.plan.probe import abstract_batch
from maxmoe.sharding import make_mesh, use_mesh
from maxmoe.train.step import make_trainer
from maxmoe.validation import dcn_sizes, validate
from tests.helpers import small_config
from tests.parallel.test_dispatch import sharded_equals_one_device

E, K, D, F, GROUPS = 8, 2, 16, 8, 4
B, S = 8, 16  # 128 tokens


def _inputs(worst: bool):
    keys = jax.random.split(jax.random.key(0), 7)
    x = jax.random.normal(keys[0], (B, S, D))
    if worst:
        idx = jnp.zeros((B, S, K), jnp.int32).at[..., 1].set(1)
    else:  # each token: K distinct experts from at most 2 of the 4 groups
        groups = jax.random.randint(keys[5], (B, S, K), 0, GROUPS)
        idx = groups * (E // GROUPS) + jnp.arange(K) % (E // GROUPS)
        idx = jnp.where(jax.random.bernoulli(keys[6], 0.5, (B, S, 1)), idx, idx[..., :1]
                        + jnp.arange(K) % (E // GROUPS))
    weights = jax.random.uniform(keys[1], (B, S, K))
    wg, wu = (0.3 * jax.random.normal(k, (E, D, F)) for k in keys[2:4])
    return x, idx, weights, wg, wu, 0.3 * jax.random.normal(keys[4], (E, F, D))


MESHES = {"expert8": dict(data=1, fsdp=1, pipeline=1, expert=8, tensor=1),
          "data2 expert4": dict(data=2, fsdp=1, pipeline=1, expert=4, tensor=1)}


@pytest.mark.parametrize("mesh, hosts, worst, kernel", [
    ("expert8", 2, False, "blocked"), ("expert8", 4, True, "blocked"),
    ("expert8", 2, True, "ragged_dot"), ("data2 expert4", 2, False, "blocked")])
def test_two_level_equals_one_device(mesh, hosts, worst, kernel):
    cfg = MoEConfig(num_experts=E, experts_per_token=K, transport="two_level",
                    num_groups=GROUPS, groups_per_token=2, expert_hosts=hosts,
                    transport_buffer_factor=1.5, grouped_matmul=kernel, block_size=8)
    stats = sharded_equals_one_device(cfg, _inputs(worst), MESHES[mesh], DEFAULT_RULES)
    assert float(stats["dropped_fraction"]) == 0.0
    if worst:  # hop 2: each of host 0's hop-1 receivers holds H T rows, all for device 0
        ep = MESHES[mesh]["expert"]
        t = B * S // (MESHES[mesh]["data"] * ep)
        per_host = ep // hosts
        pair = hosts * t * K if E // ep >= 2 else hosts * t
        assert float(stats["dispatch_rounds"]) == math.ceil(pair / math.ceil(1.5 * t * K
                                                                               / per_host))
        assert math.ceil(pair / math.ceil(1.5 * t * K / per_host)) > 1  # extra rounds ran


def test_gpu_form_lowers_with_grouped_ragged_all_to_all():
    """The GPU exchange of both hops (ragged_all_to_all over axis_index_groups, which XLA:CPU
    cannot compile) lowers, forward and backward; the dense form has no ragged op. Lowering
    only, no compile."""
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    cfg = MoEConfig(num_experts=E, experts_per_token=K, num_groups=GROUPS, groups_per_token=2,
                    grouped_matmul="ragged_dot")
    shards = ExpertShards(axes=("expert",), sizes=(8,), gathered=("expert",), sync=("expert",))
    x, idx, weights, wg, wu, wd = _inputs(worst=False)
    args = (x.reshape(-1, D), idx.reshape(-1, K), weights.reshape(-1, K), wg, wu, wd)

    def on(ragged):
        @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("expert"),) * 6,
                           out_specs=P("expert"), check_vma=False)
        def body(*a):
            return TwoLevel(cfg, shards, hosts=2, ragged=ragged)(*a).y
        return body
    text = jax.jit(jax.grad(lambda *a: jnp.sum(on(True)(*a)), argnums=(0, 2, 3))).lower(
        *args).as_text()
    assert "ragged_all_to_all" in text and "replica_groups" in text
    dense = jax.jit(on(False)).lower(*args).as_text()
    assert "ragged_all_to_all" not in dense and "all_to_all" in dense


@pytest.mark.gpu_aot
@pytest.mark.parametrize("kernel", ["blocked", "ragged_dot"])
def test_gpu_form_compiles_for_gpu_without_a_device(kernel):
    """Deviceless XLA:GPU compile of both hops, forward and backward (the venv with
    jax[cuda12], docs/gpu_aot.md; skipped without the plugin): XLA:GPU takes the grouped
    ragged-all-to-all, and with ragged_dot every while has a known trip count (the blocked
    kernel's block loops, bounded by the routing, do not)."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="jax[cuda12] plugin not installed")
    mesh = jax.sharding.Mesh(gpu_devices(4, "h100"), ("expert",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    cfg = MoEConfig(num_experts=E, experts_per_token=K, grouped_matmul=kernel, block_size=8)
    shards = ExpertShards(axes=("expert",), sizes=(4,), gathered=("expert",), sync=("expert",))
    rows = jax.sharding.NamedSharding(mesh, P("expert"))
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows) for a in (
        jnp.zeros((4 * 64, D)), jnp.zeros((4 * 64, K), jnp.int32), jnp.zeros((4 * 64, K)),
        *_inputs(worst=False)[3:])]

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("expert"),) * 6,
                       out_specs=P("expert"), check_vma=False)
    def body(*a):
        return TwoLevel(cfg, shards, hosts=2, ragged=True)(*a).y
    hlo = jax.jit(jax.grad(lambda *a: jnp.sum(body(*a)), argnums=(0, 2, 3))).lower(
        *args).compile().as_text()
    assert "ragged-all-to-all" in hlo
    assert kernel == "blocked" or unknown_trip_loops(hlo) == []


@pytest.mark.gpu_aot
def test_gpu_form_compiles_for_gpu_under_the_pipelines_vmap():
    """Both hops' ragged exchanges inside vmap(spmd_axis_name="pipeline") around the shard_map,
    as parallel/pipeline.py runs its stages (pipeline 2 x expert 4 deviceless H100s, 2 hosts
    of 2 on the expert axis): XLA:GPU compiles it, forward and backward, with ragged
    all-to-alls inside each stage's expert group (jax alone refuses to batch them:
    parallel/grouped.py)."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="jax[cuda12] plugin not installed")
    mesh = jax.sharding.Mesh(np.asarray(gpu_devices(8, "h100")).reshape(2, 4),
                             ("pipeline", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    cfg = MoEConfig(num_experts=E, experts_per_token=K, grouped_matmul="ragged_dot")
    shards = ExpertShards(axes=("expert",), sizes=(4,), gathered=("expert",), sync=("expert",))
    stage_rows = jax.sharding.NamedSharding(mesh, P("pipeline", "expert"))
    x, idx, weights, wg, wu, wd = _inputs(worst=False)
    args = [jax.ShapeDtypeStruct((2, *a.shape), a.dtype, sharding=stage_rows) for a in (
        x.reshape(-1, D), idx.reshape(-1, K), weights.reshape(-1, K), wg, wu, wd)]

    def stage(*a):  # one stage: its tokens and its own experts, split over the expert axis
        return jax.shard_map(lambda *b: TwoLevel(cfg, shards, hosts=2, ragged=True)(*b).y,
                             mesh=mesh, in_specs=(P("expert"),) * 6, out_specs=P("expert"),
                             check_vma=False)(*a)
    stages = jax.vmap(stage, spmd_axis_name="pipeline")
    hlo = jax.jit(jax.grad(lambda *a: jnp.sum(stages(*a)), argnums=(0, 2, 3))).lower(
        *args).compile().as_text()
    assert "ragged-all-to-all" in hlo


TWO_LEVEL = ["moe.transport=two_level", "moe.num_groups=4", "moe.groups_per_token=2"]


@pytest.mark.parametrize("overrides, message", [
    (["moe.transport=two_level", "mesh.expert=8", "mesh.data=1"],
     "moe.transport.*two_level needs group-limited routing.*moe.num_groups=1.*set moe.num_groups"),
    ([*TWO_LEVEL, "mesh.expert=4", "mesh.data=2", "mesh.rules.batch=[data,fsdp]"],
     "moe.transport.*one expert mesh axis that also shards the batch"),
    ([*TWO_LEVEL, "mesh.expert=8", "mesh.data=1", "moe.expert_hosts=8"],
     "moe.transport.*span 8 hosts.*moe.num_groups=4; use a host count dividing both"),
    ([*TWO_LEVEL, "mesh.expert=8", "mesh.data=1", "mesh.dcn_expert=8"],
     "moe.transport.*span 8 hosts.*mesh.dcn_expert"),
    (["moe.expert_hosts=-1"], "moe.expert_hosts.*>= 0")])
def test_bad_two_level_settings_name_key_and_fix(overrides, message):
    cfg, origins = small_config(*overrides)
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg, 8, origins)
    assert "\n" not in str(err.value)


def test_two_level_hosts_come_from_the_dcn_factor_and_the_start_up_line_says_so():
    cfg, origins = small_config(*TWO_LEVEL, "mesh.expert=8", "mesh.data=1", "mesh.dcn_expert=2")
    sizes = validate(cfg, 8, origins)
    assert resolve_transport(cfg, sizes).moe.expert_hosts == 2
    line = describe_transport(cfg, sizes)
    assert "transport two_level over 8 expert shards (set)" in line and "2 hosts x 4" in line


# pipeline 2 x expert 4, the expert axis 2 hosts x 2 devices (one process stands in for both:
# device i on host i // 4); DeepSeek-style group-limited routing, K 4 of 16 experts in 2 of 4
# groups
PIPELINED = ["mesh.pipeline=2", "mesh.expert=4", "mesh.data=1", "mesh.dcn_expert=2",
             "moe.num_experts=16", "moe.experts_per_token=4", "moe.num_groups=4",
             "moe.groups_per_token=2"]


def _expert_all_to_all_bytes(transport: str) -> dict[str, float]:
    """{"ici", "dcn"} bytes per device per step of the expert axis' all-to-alls in the
    compiled train step of PIPELINED (plan/collectives.py's counting), and the config."""
    cfg, origins = small_config(*PIPELINED, f"moe.transport={transport}")
    trainer = make_trainer(cfg, make_mesh(validate(cfg, 8, origins), dcn=dcn_sizes(cfg)))
    with use_mesh(trainer.mesh, trainer.rules):
        hlo = trainer.jitted_step.lower(trainer.abstract_state, abstract_batch(
            cfg, trainer.batch_sharding)).compile().as_text()
    comm = collective_bytes(hlo, trainer.mesh, devices_per_host=8 // cfg.mesh.dcn_expert)
    assert comm.warnings == []
    return comm.by_axis["expert"]["all-to-all"], cfg


def test_two_level_under_the_pipeline_crosses_hosts_less_in_the_compiled_step():
    """The compiled pipelined step's cross-host (DCN) bytes of the expert all-to-all: under
    two_level at most H / (c K) of all_to_all's, times the share hop 1's K expert ids and
    router weights (4 bytes each) add to a row of D. Derivation (parallel/two_level.py): hop 1
    holds (H - 1) T rows for other hosts, all_to_all (ep - L) cap >= (H - 1) / H c T K per
    exchange, and hop 1 runs no more exchanges of rows than all_to_all's rounds (dispatch and
    combine, their recomputation and transposes); hop 2 stays inside the host."""
    a2a, cfg = _expert_all_to_all_bytes("all_to_all")
    two, _ = _expert_all_to_all_bytes("two_level")
    hosts, k, c = cfg.mesh.dcn_expert, cfg.moe.experts_per_token, cfg.moe.transport_buffer_factor
    row = cfg.model.hidden_size * np.dtype(cfg.precision.compute_dtype).itemsize
    bound = hosts / (c * k) * (row + k * (4 + 4)) / row
    print(f"\nexpert all-to-all dcn bytes: all_to_all {a2a['dcn']:.0f}, two_level "
          f"{two['dcn']:.0f}, ratio {two['dcn'] / a2a['dcn']:.3f} <= {bound:.3f}")
    assert a2a["dcn"] > 0 and two["dcn"] > 0
    assert two["dcn"] <= bound * a2a["dcn"]
    assert bound < 1  # the config is one where two_level must save (H < c K)


@pytest.mark.parametrize("remat", ["full", "save_received"])
def test_hop_one_sends_the_planners_count_of_row_buffers_across_hosts(remat):
    """prerank.hop1_exchanges, which prices two_level's routed bytes, is what the
    compiled step runs: unpipelined (data 2 x expert 4 over 2 hosts, float32, remat full), the
    cross-host expert all-to-all bytes per MoE layer are exactly that many hop-1 row buffers
    ((H - 1) x T rows of D) plus 5 buffers of the (H - 1) x T x K router weights (forward,
    re-run, gradient) and expert ids (forward, re-run), 4 bytes each; with save_received the
    re-run sends none of them (4 row buffers, 3 small ones)."""
    cfg, origins = small_config("mesh.pipeline=1", "mesh.expert=4", "mesh.data=2",
                                "mesh.dcn_expert=2", "moe.num_experts=16",
                                "moe.experts_per_token=4", "moe.num_groups=4",
                                "moe.groups_per_token=2", "moe.transport=two_level",
                                f"model.remat_policy={remat}")
    assert cfg.precision.compute_dtype == "float32"
    trainer = make_trainer(cfg, make_mesh(validate(cfg, 8, origins), dcn=dcn_sizes(cfg)))
    with use_mesh(trainer.mesh, trainer.rules):
        hlo = trainer.jitted_step.lower(trainer.abstract_state, abstract_batch(
            cfg, trainer.batch_sharding)).compile().as_text()
    comm = collective_bytes(hlo, trainer.mesh, devices_per_host=8 // cfg.mesh.dcn_expert)
    m, hosts = cfg.model, cfg.mesh.dcn_expert
    layers = sum(n for is_moe, _, n in layer_groups(m) if is_moe) + m.mtp_depth
    tokens = cfg.data.global_batch_size * cfg.data.seq_len // 8  # the batch over data x expert
    rows = (hosts - 1) * tokens * m.hidden_size * 4
    small = (hosts - 1) * tokens * cfg.moe.experts_per_token * 4
    exchanges, dispatches = hop1_exchanges(*hop1_reruns(remat, 0))
    assert exchanges == {"full": 5, "save_received": 4}[remat]
    want = layers * (exchanges * rows + (2 * dispatches + 1) * small)
    assert comm.by_axis["expert"]["all-to-all"]["dcn"] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("remat,layers,rows_per_iteration,unread", [
    ("full", 5, 12, 2), ("none", 5, 11, 0), ("save_received", 5, 11, 0), ("full", 3, 5, 0),
    ("none", 3, 5, 0)])
def test_pipelined_hop_one_row_buffers_on_xla_cpu(remat, layers, rows_per_iteration, unread):
    """prerank.hop1_reruns under a pipeline (pipeline 2 x expert 4 over 2 hosts, gpipe, 2
    microbatches: 3 iterations), compiled by XLA:CPU, as XLA:GPU compiles it
    (tests/plan/test_gpu_pipeline_reruns.py): under remat full a stage's backward re-runs its
    slots but the last one iteration ahead (parallel/pipeline_loop.Loop: dispatch and combine) and
    each block's vjp re-runs its dispatch, so at 2 slots a stage (4 MoE layers) sends 12 hop-1
    row buffers per iteration, and the last backward iteration's re-run ahead, read by none,
    2 more a step; under none and save_received a stage's backward runs its slots' forward
    once: 11 (2 x 5 + 1); at one slot (2 MoE layers) 5. Plus the router-weight and expert-id
    buffers (less than one row buffer's bytes in all, at hidden 256)."""
    cfg, origins = small_config("mesh.pipeline=2", "mesh.expert=4", "mesh.dcn_expert=2",
                                "moe.num_experts=16", "moe.experts_per_token=4",
                                "moe.num_groups=4", "moe.groups_per_token=2",
                                "moe.transport=two_level", f"model.remat_policy={remat}",
                                f"model.num_layers={layers}", "model.hidden_size=256")
    trainer = make_trainer(cfg, make_mesh(validate(cfg, 8, origins), dcn=dcn_sizes(cfg)))
    with use_mesh(trainer.mesh, trainer.rules):
        hlo = trainer.jitted_step.lower(trainer.abstract_state, abstract_batch(
            cfg, trainer.batch_sharding)).compile().as_text()
    comm = collective_bytes(hlo, trainer.mesh, devices_per_host=8 // cfg.mesh.dcn_expert)
    m, hosts, moe_layers = cfg.model, cfg.mesh.dcn_expert, layers - 1
    schedule = pipeline_schedule(m, cfg.mesh.pipeline)
    assert schedule.pipelines(moe_layers) and cfg.model.mtp_depth == 0
    tokens = cfg.data.global_batch_size * cfg.data.seq_len // 4 // schedule.microbatches
    rows = (hosts - 1) * tokens * m.hidden_size * 4
    small = (hosts - 1) * tokens * cfg.moe.experts_per_token * 4
    exchanges, _ = hop1_exchanges(*hop1_reruns(remat, schedule.slots(moe_layers)))
    assert schedule.slots(moe_layers) * exchanges == pytest.approx(rows_per_iteration)
    total = comm.by_axis["expert"]["all-to-all"]["dcn"]
    assert total // rows == schedule.iterations * rows_per_iteration + unread
    assert (total % rows) % small == 0 and total % rows > 0


def test_pipelined_block_remat_runs_the_routers_as_priced():
    """With a stage's slots unrolled (model/block.run_layers), XLA:CPU runs each MoE layer's
    router (its TopK) as metrics.flops.pipelined_reruns prices it: under none a stage's
    backward runs its pass forward once (2 forwards a step); under full the slots but the last
    once more, one iteration ahead, and every block once in its vjp (1 + 1.5 at 2 slots), plus
    the last backward iteration's pass ahead that no iteration reads (its slots but the last)."""
    def compiled(remat):
        cfg, origins = small_config("mesh.pipeline=2", "mesh.expert=4", "mesh.dcn_expert=2",
                                    "moe.num_experts=16", "moe.experts_per_token=4",
                                    "moe.num_groups=4", "moe.groups_per_token=2",
                                    "moe.transport=two_level", f"model.remat_policy={remat}",
                                    "model.num_layers=5", "moe.grouped_matmul=ragged_dot")
        trainer = make_trainer(cfg, make_mesh(validate(cfg, 8, origins), dcn=dcn_sizes(cfg)))
        with use_mesh(trainer.mesh, trainer.rules):
            return matmul_flops(trainer.jitted_step.lower(trainer.abstract_state, abstract_batch(
                cfg, trainer.batch_sharding)).compile().as_text())
    full, none = compiled("full"), compiled("none")
    slots, iterations = 2, 3  # 4 MoE layers on 2 stages; gpipe, 2 microbatches
    forward = none.uncounted["TopK"] / (1 + pipelined_reruns("none", slots))
    per_router = forward / (iterations * slots)  # group-limited routing: 2 TopKs a router
    assert per_router in (1, 2)
    unread = (slots - 1) * per_router
    assert full.uncounted["TopK"] == forward * (1 + pipelined_reruns("full", slots)) + unread
