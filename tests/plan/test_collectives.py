"""collective_bytes against programs whose communication is computed by hand.

Expected bytes come from the shapes and the ring formulas in the module docstring
(all-reduce 2(n-1)/n x buffer, all-gather (n-1)/n x full result, ...), derived here from the
program's own shapes, not from the parser. Tolerance: exact up to float rounding (rel 1e-9).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from maxmoe.bench import synthetic_batch
from maxmoe.plan.collectives import collective_bytes, replica_groups, summarize
from maxmoe.plan.hlo import attr, parse_instruction, shape_bytes
from maxmoe.sharding import global_batch, make_mesh, use_mesh
from maxmoe.train.setup import prepare_run
from maxmoe.validation import validate
from tests.helpers import small_config

F32 = 4
SHAPE = (8, 16, 32)  # global; P("a", "b", "c") on a 2x2x2 mesh leaves (4, 8, 16) per device
LOCAL = 4 * 8 * 16 * F32
ABC = P("a", "b", "c")


def _mesh():
    return jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Explicit,) * 3)


def _hlo(fn, mesh, out_spec, in_spec=ABC, shape=SHAPE):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec))
    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, in_spec))
    return f.lower(x).compile().as_text()


def _only(result):
    """The single (axis, kind, ici, dcn) entry of a result."""
    rows = [(a, k, v["ici"], v["dcn"]) for a, ks in result.by_axis.items() for k, v in ks.items()]
    assert len(rows) == 1, rows
    return rows[0]


def test_psum_over_one_axis_is_an_all_reduce_on_that_axis():
    mesh = _mesh()
    text = _hlo(lambda x: jax.lax.psum(x, "b"), mesh, P("a", None, "c"))
    axis, kind, ici, dcn = _only(collective_bytes(text, mesh, devices_per_host=8))
    assert (axis, kind) == ("b", "all-reduce")
    assert ici == pytest.approx(2 * (2 - 1) / 2 * LOCAL, rel=1e-9) and dcn == 0


def test_all_gather_of_an_fsdp_sharded_weight():
    """Replicating a [64, 32] float32 weight split 4 ways over fsdp is one all-gather on fsdp of
    (4 - 1) / 4 x the full result's bytes, all on ICI (8 devices a host)."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    f = jax.jit(lambda w: w * 2.0, out_shardings=NamedSharding(mesh, P()))
    result = collective_bytes(f.lower(w).compile().as_text(), mesh, devices_per_host=8)
    axis, kind, ici, dcn = _only(result)
    assert (axis, kind) == ("fsdp", "all-gather")
    assert ici == pytest.approx((4 - 1) / 4 * 64 * 32 * F32, rel=1e-9) and dcn == 0


def test_scan_multiplies_by_the_trip_count():
    def body(c, _):
        return jax.lax.all_gather(c, "a", tiled=True)[: c.shape[0]] * 2.0, None

    mesh, steps = _mesh(), 5
    text = _hlo(lambda x: jax.lax.scan(body, x, None, length=steps)[0], mesh,
                P("a", "b", "c"))
    result = collective_bytes(text, mesh, devices_per_host=8)
    axis, kind, ici, _ = _only(result)
    assert (axis, kind) == ("a", "all-gather")
    assert ici == pytest.approx(steps * (2 - 1) / 2 * (2 * LOCAL), rel=1e-9)
    assert result.warnings == []


@pytest.mark.parametrize("axes, n_over", [("c", "ici"), ("a", "dcn"), (("a", "b", "c"), "mix")])
def test_ici_dcn_split_with_two_devices_per_host(axes, n_over):
    # hosts {0,1} {2,3} {4,5} {6,7}: "c" (stride 1) stays inside, "a" (stride 4) goes across
    """Hosts of 2 devices: a psum over the stride-1 axis stays on ICI, over the stride-4 axis
    goes wholly over DCN, and over all 8 devices splits the ring's bytes (g - 1) / (n - 1) = 1/7
    ICI and 6/7 DCN."""
    mesh = _mesh()
    text = _hlo(lambda x: jax.lax.psum(x, axes), mesh,
                P(*(None if a in axes else a for a in "abc")))
    axis, kind, ici, dcn = _only(collective_bytes(text, mesh, devices_per_host=2))
    n = 2 if n_over != "mix" else 8
    sent = 2 * (n - 1) / n * LOCAL
    assert kind == "all-reduce" and axis == "+".join(axes)
    want = {"ici": (sent, 0.0), "dcn": (0.0, sent), "mix": (sent / 7, sent * 6 / 7)}[n_over]
    assert (ici, dcn) == pytest.approx(want, rel=1e-9)


def test_replica_group_forms_parse():
    """Each of HLO's replica_groups spellings (explicit lists, iota [G,S]<=[N], iota with a
    transpose, the mesh[...] device_ids form, empty = all devices) reads to the same device
    groups as written out by hand."""
    pairs = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert replica_groups("replica_groups={{0,1},{2,3},{4,5},{6,7}}, x=1", 8) == pairs
    assert replica_groups("channel_id=1, replica_groups=[4,2]<=[8], dimensions={0}", 8) == pairs
    # iota(8).reshape(2,2,2).transpose(2,1,0)[i,j,k] = 4k + 2j + i, read in (i, j, k) order
    assert replica_groups("replica_groups=[4,2]<=[2,2,2]T(2,1,0)", 8) == [
        [0, 4], [2, 6], [1, 5], [3, 7]]
    # devices [0,1,4,5,2,3,6,7] on a (1,2,1,1,4) mesh; groups vary axis_1 only
    mesh_form = ("replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=1,'axis_3'=1,'axis_4'=4], "
                 "device_ids=([2,2,2]T(1,0,2)) {'axis_1'}, metadata={}")
    assert replica_groups(mesh_form, 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert replica_groups("replica_groups={}", 4) == [[0, 1, 2, 3]]


def test_instruction_and_shape_parse():
    """An HLO instruction line reads to its name, opcode and operands, and a tuple type's bytes
    are the sum of its elements' (bf16 2 bytes, s32 4)."""
    ins = parse_instruction("  %a2a = (bf16[1,8,16]{2,1,0}, /*index=1*/s32[3]{0}) all-to-all("
                            "%p.1, %p.2), channel_id=1, replica_groups={{0,1}}")
    assert (ins.name, ins.opcode, ins.operands) == ("a2a", "all-to-all", ["%p.1", "%p.2"])
    assert shape_bytes(ins.type) == 1 * 8 * 16 * 2 + 3 * 4


LITERAL = """HloModule m

%body (p: (s32[], f32[256])) -> (s32[], f32[256]) {
  %p = (s32[], f32[256]{0}) parameter(0)
  %x = f32[256]{0} get-tuple-element(%p), index=1
  %ar = f32[256]{0} all-reduce(%x), channel_id=1, replica_groups=[4,2]<=[8], to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[256]{0}) tuple(%i, %ar)
}

%cond (p: (s32[], f32[256])) -> pred[] {
  %p.c = (s32[], f32[256]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%big (q: bf16[1024]) -> bf16[1024] {
  %q = bf16[1024]{0} parameter(0)
  ROOT %cp = bf16[1024]{0} collective-permute(%q), channel_id=2, source_target_pairs={{0,1},{1,0}}
}

%small (r: bf16[1024]) -> bf16[1024] {
  ROOT %r = bf16[1024]{0} parameter(0)
}

ENTRY %main (x0: f32[256], y0: bf16[1024], k: s32[]) -> f32[256] {
  %x0 = f32[256]{0} parameter(0)
  %y0 = bf16[1024]{0} parameter(1)
  %k = s32[] parameter(2)
  %init = (s32[], f32[256]{0}) tuple(%k, %x0)
  %w1 = (s32[], f32[256]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"7"}}
  %w2 = (s32[], f32[256]{0}) while(%init), condition=%cond, body=%body
  %c = bf16[1024]{0} conditional(%k, %y0, %y0), branch_computations={%small, %big}
  ROOT %out = f32[256]{0} get-tuple-element(%w1), index=1
}
"""


def test_trip_counts_unknown_loops_and_conditionals_on_literal_hlo():
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    result = collective_bytes(LITERAL, mesh, devices_per_host=8)
    # 7 known + 1 unknown (counted once) iterations of a 2-device all-reduce of f32[256]
    assert result.by_axis["y"]["all-reduce"]["ici"] == pytest.approx(8 * 1024, rel=1e-9)
    # the costlier branch: devices 0 and 1 each send bf16[1024]; averaged over 8 devices
    assert result.by_axis["y"]["collective-permute"]["ici"] == pytest.approx(2 * 2048 / 8)
    assert len(result.warnings) == 1 and "w2" in result.warnings[0]
    assert "y" in summarize(result) and "warning: while w2" in summarize(result)


# op_names XLA:GPU (the first three) and XLA:CPU (the last) gave the rounds loops of tiny
# DeepSeek-V3's train step (forward, its remat in the backward, and the backward's own loop)
ROUNDS_OP_NAMES = [
    "jit(train_step)/jvp()/while/body/closed_call/moe/shard_map/exchange_rounds/closed_call/while",
    "jit(train_step)/jvp(moe)/shard_map/exchange_rounds/while",
    "jit(train_step)/jvp()/while/body/eval_jaxpr/moe/shard_map/exchange_rounds/eval_jaxpr/while",
    "jit(train_step)/transpose(jvp())/while/body/eval_jaxpr/checkpoint/moe/shard_map/"
    "exchange_rounds/while"]


@pytest.mark.parametrize("op_name", ROUNDS_OP_NAMES)
def test_all_to_all_rounds_loop_counts_once(op_name):
    """The rounds loop's static trip count is the worst routing's; a ragged exchange sends each
    assignment once over all rounds, so its collectives count once (module docstring)."""
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    rounds = LITERAL.replace('body=%body, backend_config={"known_trip_count"',
                             f'body=%body, metadata={{op_name="{op_name}"}}, '
                             'backend_config={"known_trip_count"')
    assert rounds != LITERAL
    result = collective_bytes(rounds, mesh, devices_per_host=8)
    # w1 (7 trips, the rounds scope) once + w2 (unknown) once
    assert result.by_axis["y"]["all-reduce"]["ici"] == pytest.approx(2 * 1024, rel=1e-9)
    assert len(result.warnings) == 1 and "w2" in result.warnings[0]  # w1's count is known



def test_a_loop_inside_the_rounds_body_counts_its_trips():
    """A loop nested in the rounds loop's body (the blocked kernel's, on XLA:CPU) is not the
    rounds loop: its collectives count trip-count times."""
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    nested = ("jit(train_step)/jvp(moe)/shard_map/exchange_rounds/while/body/closed_call/"
              "grouped_matmul/while")
    text = LITERAL.replace('body=%body, backend_config={"known_trip_count"',
                           f'body=%body, metadata={{op_name="{nested}"}}, '
                           'backend_config={"known_trip_count"')
    result = collective_bytes(text, mesh, devices_per_host=8)
    assert result.by_axis["y"]["all-reduce"]["ici"] == pytest.approx(8 * 1024, rel=1e-9)

@pytest.mark.slow
def test_tiny_train_step_on_fsdp_expert_tensor():
    """The compiled train step of the small model on fsdp 2 x expert 2 x tensor 2 (one host)
    sends bytes over each of fsdp, expert and tensor, none over data or pipeline (size 1), and
    nothing over DCN."""
    cfg, origins = small_config("mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2")
    setup = prepare_run(cfg, validate(cfg, 8, origins))
    trainer = setup.trainer
    batch = global_batch(synthetic_batch(cfg), trainer.batch_sharding)
    with use_mesh(trainer.mesh, trainer.rules):
        text = trainer.jitted_step.lower(trainer.abstract_state, batch).compile().as_text()
    result = collective_bytes(text, trainer.mesh, devices_per_host=8)
    per_axis = {a: 0.0 for a in trainer.mesh.axis_names}
    for label, kinds in result.by_axis.items():
        for axis in label.split("+"):
            per_axis[axis] += sum(v["ici"] + v["dcn"] for v in kinds.values())
    assert all(per_axis[a] > 0 for a in ("fsdp", "expert", "tensor")), per_axis
    assert per_axis["data"] == 0 and per_axis["pipeline"] == 0, per_axis
    assert result.total("dcn") == 0 and result.total("ici") > 0


def test_partition_ids_follow_the_mesh_order_not_device_ids():
    # with a DCN factor make_mesh reorders devices (flat order 0,1,4,5,2,3,6,7): a psum over
    # "data" pairs flat positions (i, i+4), devices (0,2),(1,3),(4,6),(5,7), each inside one
    # host of 4. Read as device ids, the pairs (0,4)... would label "fsdp" and cross hosts.
    mesh = make_mesh(dict(data=2, fsdp=2, pipeline=1, expert=2, tensor=1), dcn=dict(fsdp=2))
    assert [d.id for d in mesh.devices.flat] != list(range(8))
    text = _hlo(lambda x: jax.lax.psum(x, "data"), mesh, P(None, "fsdp"),
                in_spec=P("data", "fsdp"), shape=(4, 4))
    axis, kind, ici, dcn = _only(collective_bytes(text, mesh, devices_per_host=4))
    sent = 2 * (2 - 1) / 2 * 2 * 2 * F32
    assert (axis, kind) == ("data", "all-reduce")
    assert (ici, dcn) == pytest.approx((sent, 0.0), rel=1e-9)


def test_attr_reads_values_bracketed_plain_empty_and_absent():
    """hlo.attr: a bracket-balanced value, a plain one, the iota replica-group form, an empty
    value at the end of the list (was an IndexError), and a key that is not there."""
    attrs = "replica_groups={{0,1},{2,3}}, channel_id=5, dims=[2,4]<=[8]T(1,0), to_apply="
    assert attr(attrs, "replica_groups") == "{{0,1},{2,3}}"
    assert attr(attrs, "channel_id") == "5"
    assert attr(attrs, "dims") == "[2,4]<=[8]T(1,0)"
    assert attr(attrs, "to_apply") == ""
    assert attr(attrs, "index") is None
