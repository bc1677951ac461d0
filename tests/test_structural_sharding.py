"""Every large train-state leaf is split over every mesh axis, on every layout we claim.

Replicated math gives the same numbers, so the equivalence tests cannot see a replicated
weight; this test reads the shardings themselves. Shapes only: the train state as
`state_layout` builds it for make_trainer (params, optimizer state, buffers, counters) on an
AbstractMesh, so an 8-device test process checks 2048-device layouts.

Bound: per-device state <= 1.05 x ideal (total bytes / devices) + the per-device bytes of
the ALLOWED leaves (norm scales, the router's selection bias, counters). Every other leaf
over 1 MiB must be split over all devices; an allowed leaf may hold at most 1 MiB a device.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from maxmoe.config import MESH_AXES, CheckpointConfig
from maxmoe.config_files import load_config
from maxmoe.model.spec import layer_groups
from maxmoe.model.transformer import build_model
from maxmoe.parallel.schedule import pipeline_schedule
from maxmoe.plan.estimate import state_bytes
from maxmoe.plan.probe import replicated_leaves
from maxmoe.sharding import make_mesh, stack_source_spec, state_dim_axes
from maxmoe.train.checkpoint import Checkpointer
from maxmoe.train.step import make_trainer, state_layout
from maxmoe.validation import validate
from tests.helpers import small_config
from tests.test_sharded_equivalence import LAYOUTS, PIPELINE, PIPELINE_LAYOUTS

MIB = 2**20
SLACK = 1.05
# what may stay (partly) replicated: norm scales (a vector per layer; its one dim is often
# too short for every axis), the router's selection bias [layers, experts], and counters
# (the step, the optimizer's count, the guard's statistics, the loss scale, the router
# health's [L_moe, E] load window)
ALLOWED = re.compile(r"norm'\]\['scale'\]|\['buffers'\].*\['bias'\]$|"
                     r"^\['(step|guard|loss_scale|router_health)'\]")

V3 = "configs/models/deepseek_v3_671b.yaml"
V3_MESH = ["data.seq_len=4096", "data.global_batch_size=2048"]
BIG = {  # name -> (model file, devices, overrides)
    "671b_ep64_fsdp32": (V3, 2048, V3_MESH + [
        "mesh.data=1", "mesh.expert=64", "mesh.fsdp=32", "mesh.dcn_expert=8", "mesh.dcn_fsdp=32"]),
    "671b_data2_ep64_fsdp16": (V3, 2048, V3_MESH + [
        "mesh.data=2", "mesh.expert=64", "mesh.fsdp=16", "mesh.dcn_data=2", "mesh.dcn_expert=8",
        "mesh.dcn_fsdp=16"]),
    "671b_pipeline2_ep64_fsdp16": (V3, 2048, V3_MESH + [
        "mesh.data=1", "mesh.pipeline=2", "mesh.expert=64", "mesh.fsdp=16", "mesh.dcn_pipeline=2",
        "mesh.dcn_expert=8", "mesh.dcn_fsdp=16"]),
    "13b_fsdp4_tensor2": ("configs/models/deepseek_13b.yaml", 8, [
        "data.global_batch_size=256", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"]),
    "13b_fsdp8": ("configs/models/deepseek_13b.yaml", 8, [
        "data.global_batch_size=256", "mesh.data=1", "mesh.fsdp=8"]),
}


def abstract_state(cfg, sizes):
    mesh = AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return state_layout(cfg, mesh).abstract


def check_fully_sharded(abstract, devices: int) -> tuple[int, int]:
    """Asserts the bound of the module docstring; returns (per-device bytes, ideal bytes)."""
    total = per_device = allowed = 0
    failures = []
    for path, a in jax.tree_util.tree_leaves_with_path(abstract):
        name = jax.tree_util.keystr(path)
        full = math.prod(a.shape) * a.dtype.itemsize
        mine = math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
        total, per_device = total + full, per_device + mine
        if ALLOWED.search(name):
            allowed += mine
            if mine > MIB:
                failures.append(f"{name} {a.shape} {a.sharding.spec}: allowed leaf holds "
                                f"{mine / MIB:.1f} MiB a device")
        elif full > MIB and math.prod(a.shape) != devices * math.prod(
                a.sharding.shard_shape(a.shape)):
            split = math.prod(a.shape) // math.prod(a.sharding.shard_shape(a.shape))
            failures.append(f"{name} {a.shape} {a.sharding.spec}: split {split} ways, not "
                            f"{devices}")
    assert not failures, "\n".join(failures)
    ideal = total / devices
    assert per_device <= SLACK * ideal + allowed, (per_device, ideal, allowed)
    return per_device, round(ideal)


@pytest.mark.parametrize("name", sorted(LAYOUTS) + sorted(PIPELINE_LAYOUTS))
def test_equivalence_layouts_shard_the_whole_state(name):
    overrides = LAYOUTS.get(name) or PIPELINE + PIPELINE_LAYOUTS[name]
    cfg, origins = small_config(*overrides)
    sizes = validate(cfg, 8, origins)
    check_fully_sharded(abstract_state(cfg, sizes), 8)


@pytest.mark.parametrize("name", sorted(BIG))
def test_big_presets_shard_the_whole_state(name):
    model, devices, overrides = BIG[name]
    cfg, origins = load_config([model], overrides)
    sizes = validate(cfg, devices, origins)
    abstract = abstract_state(cfg, sizes)
    per_device, ideal = check_fully_sharded(abstract, devices)
    print(f"{name}: state {per_device / 2**30:.3f} GiB a device, ideal {ideal / 2**30:.3f} GiB")
    # the planner's analytic estimate and its replicated list see the same placement
    state = state_bytes(cfg, sizes)
    model_state = {k: abstract[k] for k in ("params", "opt_state", "buffers") if k in abstract}
    counters = sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                   for k in abstract if k not in model_state for a in jax.tree.leaves(abstract[k]))
    assert state.total == per_device - counters
    assert state.replicated_bytes == sum(b for _, b in replicated_leaves(abstract, devices))


@pytest.mark.slow
def test_a_state_saved_on_one_layout_restores_onto_another(tmp_path):
    """Orbax reshards a checkpoint onto the new placement: saved with data 2 x fsdp 2 x
    expert 2, restored onto fsdp 4 x tensor 2 and onto one device; every leaf equal."""
    def trainer(*overrides, devices=8):
        cfg, origins = small_config(*overrides)
        sizes = validate(cfg, devices, origins)
        return make_trainer(cfg, make_mesh(sizes, jax.devices()[:devices]))

    saved = trainer("mesh.fsdp=2", "mesh.expert=2").init()
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1)) as ckpt:
        ckpt.save(1, saved)
        for target in (trainer("mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"),
                       trainer("mesh.data=1", devices=1)):
            restored, _ = ckpt.restore(target.abstract_state)
            for r, s, t in zip(jax.tree.leaves(restored), jax.tree.leaves(saved),
                               jax.tree.leaves(target.state_shardings), strict=True):
                assert r.sharding == t
                np.testing.assert_array_equal(np.asarray(r), np.asarray(s))


def test_a_replicated_weight_fails_with_its_path_shape_and_spec():
    """The check can fail: a 4 MiB weight split over fsdp but not expert is named."""
    mesh = AbstractMesh((1, 4, 1, 2, 1), MESH_AXES, axis_types=(AxisType.Auto,) * 5)
    w = jax.ShapeDtypeStruct((1024, 1024), "float32", sharding=NamedSharding(mesh, P("fsdp")))
    with pytest.raises(AssertionError, match=r"\['w'\] \(1024, 1024\) .*'fsdp'.* split 4 ways"):
        check_fully_sharded({"params": {"w": w}}, 8)


SIZES = {"data": 2, "fsdp": 4, "pipeline": 1, "expert": 8, "tensor": 1}
RULES = {"embed": ["fsdp"], "heads": ["tensor"], "layers": ["pipeline"], "experts": ["expert"]}


@pytest.mark.parametrize("logical, shape, axes, unplaced", [
    # the rules' fsdp on embed; expert and data go to the largest dims they divide (ties: first)
    (("embed", "heads"), (64, 16), [("fsdp", "expert"), ("data",)], ()),
    # fsdp does not divide embed 6: it moves to the other dim instead of being dropped
    (("embed", "heads"), (6, 64), [("data",), ("expert", "fsdp")], ()),
    # a stacked layer dim never takes an axis; what nothing divides is left unplaced
    (("layers", "embed"), (64, 12), [(), ("fsdp",)], ("expert", "data")),
])
def test_state_dim_axes_places_every_axis_it_can(logical, shape, axes, unplaced):
    assert state_dim_axes(logical, RULES, SIZES, shape) == (axes, unplaced)


def test_state_dim_axes_on_one_device_shards_nothing():
    sizes = dict.fromkeys(SIZES, 1)
    assert state_dim_axes(("embed", "heads"), RULES, sizes, (64, 16)) == ([(), ()], ())


# 671B on 16 stages (58 MoE layers: 16 does not divide them), the rules' defaults and with the
# stage axis on `embed` too (the pipelined layout of docs/performance/parallelism.md)
V3_PIPELINE = ["data.seq_len=4096", "data.global_batch_size=4096", "mesh.data=1", "mesh.fsdp=2", "mesh.pipeline=16", "mesh.expert=64",
                         "mesh.dcn_fsdp=2", "mesh.dcn_pipeline=16", "mesh.dcn_expert=8",
                         "model.pipeline_microbatches=32", "model.pipeline_schedule=circular",
                         "model.pipeline_repeats=2"]


@pytest.mark.parametrize("rules", [[], ["mesh.rules.embed=[fsdp,pipeline]"]])
def test_pipelined_stacks_are_read_split_over_the_stages(rules):
    """The pipeline regroups each stacked layer param from `stack_source_spec`: every leaf of
    the pipelined group over 1 MiB is read split over the stage axis (1/16 of it a device at
    most), not whole on every device, which is what the rules' own spec gives when the stages
    do not divide the layers (f32 [58, 768, 128, 192] compute copies of the MLA stacks)."""
    cfg, origins = load_config([V3], V3_PIPELINE + rules)
    sizes = validate(cfg, 2048, origins)
    schedule = pipeline_schedule(cfg.model, sizes["pipeline"])
    model = nnx.eval_shape(lambda: build_model(cfg, 0))
    [group] = [g for g, (_, _, n) in zip(model.layer_groups, layer_groups(cfg.model), strict=True)
               if schedule.pipelines(n)]
    failures, checked = [], 0
    for path, var in jax.tree_util.tree_leaves_with_path(
            nnx.state(group), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        shape = var.get_value().shape
        whole = math.prod(shape) * var.get_value().dtype.itemsize
        source = stack_source_spec(var, cfg.mesh.rules, sizes)
        split = math.prod(sizes[a] for a in jax.tree.leaves(tuple(source)))
        assert shape[0] == 58 and whole % split == 0
        if whole > MIB:
            checked += 1
            if "pipeline" not in jax.tree.leaves(tuple(source)):
                failures.append(f"{jax.tree_util.keystr(path)} {shape} {source}: "
                                f"{whole / split / MIB:.0f} MiB a device, whole over the stages")
    assert checked >= 10 and not failures, "\n".join(failures)
