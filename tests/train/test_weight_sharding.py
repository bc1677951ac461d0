"""mesh.weights (zero3 | zero1 | hsdp) changes where compute reads the weights and when
gradients are reduced, never what the step computes or what the state holds.

Properties:
- every mode's accumulated gradients (train.grad_accum_steps=2) on 8 devices equal one
  device's, float32 compute, to rtol 1e-4 / atol 1e-6 (the equivalence matrix's tolerance:
  only the order of float32 sums differs); loss within 1e-5 relative;
- the compute copy's layout (sharding.compute_axes): zero1 replicates every param over data
  and fsdp but keeps the experts over the expert axis and a stack over the stages; hsdp adds
  back only the storage axes that stay inside a host;
- the train state is placed the same in every mode, so a checkpoint saved under one restores
  under another (checkpoints stay layout-independent).
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxmoe.config import CheckpointConfig
from maxmoe.sharding import compute_axes, make_mesh, use_mesh
from maxmoe.train.checkpoint import Checkpointer
from maxmoe.train.gradients import make_gradients
from maxmoe.train.step import make_trainer, state_layout
from maxmoe.validation import dcn_sizes, validate
from tests.helpers import assert_grads_close, random_batch, small_config

ACCUM = ["train.grad_accum_steps=2"]
LAYOUTS = {
    "data2_fsdp2_expert2": ["mesh.fsdp=2", "mesh.expert=2"],
    # 2 hosts of 4: fsdp across hosts, expert inside; hsdp keeps the expert split in the copy
    "fsdp2dcn_expert4": ["mesh.fsdp=2", "mesh.dcn_fsdp=2", "mesh.expert=4"],
    "pipeline2_expert2_fsdp2": ["model.num_layers=5", "mesh.pipeline=2", "mesh.expert=2",
                                "mesh.fsdp=2", "model.pipeline_microbatches=4",
                                "data.global_batch_size=32"],
    # the recipe's storage over the stages (mesh.rules embed: [fsdp, pipeline]) with the
    # work outside the pipeline in row groups: the dense layers (3, as V3's: a layer scan),
    # embedding and LM head run on a copy replicated over the stages (sharding.compute_axes,
    # staged False), the dense stack on replicas over fsdp x expert x pipeline
    # (gradients.unpiped_groups); circular, 2 repeats as the recipe, so 3 layers are fewer
    # than the 4 chunks and run outside the pipeline
    "pipeline2_outer_rows": ["model.num_layers=7", "model.num_dense_layers=3", "mesh.pipeline=2",
                             "mesh.expert=2", "mesh.fsdp=2", "model.pipeline_microbatches=4",
                             "model.pipeline_schedule=circular", "model.pipeline_repeats=2",
                             "data.global_batch_size=32", "model.outer_microbatches=2",
                             "mesh.rules.embed=[fsdp, pipeline]"],
}


def gradients(overrides, batch, num_devices):
    """(loss, grads) of the first step's accumulated gradients on num_devices devices."""
    cfg, origins = small_config(*overrides)
    sizes = validate(cfg, num_devices, origins)
    mesh = make_mesh(sizes, jax.devices()[:num_devices], dcn=dcn_sizes(cfg))
    layout = state_layout(cfg, mesh)
    with use_mesh(mesh, cfg.mesh.rules):
        micro = P(None, *jax.sharding.NamedSharding(mesh, P()).spec)
        state = jax.jit(layout.init_state, out_shardings=layout.shardings)()
        grad_fn = make_gradients(cfg, layout.graphdef, micro, layout.compute)
        buffers = (state["buffers"],) if "buffers" in state else ()
        grads, metrics = jax.jit(grad_fn)(state["params"], batch, buffers, None)
    return jax.device_get((metrics["loss"], grads))


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(layers):
        if layers not in cache:
            cfg, _ = small_config(*ACCUM, *layers)
            batch = random_batch(cfg)
            cache[layers] = batch, gradients([*ACCUM, *layers], batch, 1)
        return cache[layers]
    return get


# hsdp where it differs from both zero3 and zero1: fsdp across hosts, expert inside (on the
# other layouts every axis is inside one host, where hsdp's copy is the stored layout)
CASES = [("data2_fsdp2_expert2", "zero1"), ("fsdp2dcn_expert4", "zero1"),
         ("fsdp2dcn_expert4", "hsdp"), ("pipeline2_expert2_fsdp2", "zero1"),
         ("pipeline2_outer_rows", "zero1")]


# the outer part over 2 row groups with MTP: the head and final norms on the copy's outer
# replicas (ComputeCopy.outer), the head chunked (model.lm_loss_chunk) and whole
OUTER = ["model.mtp_depth=1", "model.outer_microbatches=2", "data.global_batch_size=32"]


@pytest.mark.parametrize("name", ["data2_fsdp2_expert2", "pipeline2_expert2_fsdp2"])
@pytest.mark.parametrize("chunk", [0, 16])
def test_zero1_outer_replicas_match_one_device(name, chunk, reference):
    """zero1 with the LM head and final norms on one replica per batch-axis group (their
    gradients added once per step) equals one device: loss within 1e-5 relative, gradients
    as test_weight_modes_match_one_device's."""
    model = (*OUTER, f"model.lm_loss_chunk={chunk}")
    layers = tuple(o for o in LAYOUTS[name] if o.startswith(("model.", "data."))) + model
    batch, (ref_loss, ref_grads) = reference(layers)
    loss, grads = gradients([*ACCUM, *LAYOUTS[name], *model, "mesh.weights=zero1"], batch, 8)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("name, weights", CASES)
def test_weight_modes_match_one_device(name, weights, reference):
    layers = tuple(o for o in LAYOUTS[name] if o.startswith(("model.", "data.")))
    batch, (ref_loss, ref_grads) = reference(layers)
    loss, grads = gradients([*ACCUM, *LAYOUTS[name], f"mesh.weights={weights}"], batch, 8)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_grads_close(grads, ref_grads)


def test_compute_axes_by_mode():
    rules = {"experts": ["expert"], "embed": ["fsdp"], "expert_mlp": ["tensor"],
             "layers": ["pipeline"], "stage": ["pipeline"], "heads": ["tensor"]}
    sizes = {"data": 2, "fsdp": 4, "pipeline": 1, "expert": 2, "tensor": 1}
    dcn = {"data": 2}  # data across hosts, fsdp and expert inside
    expert_w = (("experts", "embed", "expert_mlp"), (8, 64, 32))
    attn_w = (("embed", "heads"), (64, 4))
    def axes(mode):
        return {n: compute_axes(logical, rules, sizes, shape, mode, dcn)
                for n, (logical, shape) in {"e": expert_w, "a": attn_w}.items()}
    store, zero1, hsdp = axes("zero3"), axes("zero1"), axes("hsdp")
    used = {n: {a for ax in v for a in ax} for n, v in store.items()}
    assert used["e"] == used["a"] == {"data", "fsdp", "expert"}  # ZeRO-3: every axis
    assert zero1["e"] == [("expert",), (), ()] and zero1["a"] == [(), ()]
    # hsdp: fsdp (inside a host) back on the dim storage put it; data (across hosts) never
    for n in ("e", "a"):
        assert all("data" not in ax for ax in hsdp[n])
        assert {a for ax in hsdp[n] for a in ax} == used[n] - {"data"}


def test_stack_keeps_its_stages_under_zero1():
    """A 3-layer stack on 2 stages: storage puts the stages on another dim; the zero1 copy
    keeps them there (each device holds its stage's share, not the whole stack)."""
    rules = {"experts": ["expert"], "embed": ["fsdp"], "layers": ["pipeline"],
             "stage": ["pipeline"]}
    sizes = {"data": 1, "fsdp": 2, "pipeline": 2, "expert": 2, "tensor": 1}
    logical, shape = ("layers", "experts", "embed"), (3, 4, 64)
    axes = compute_axes(logical, rules, sizes, shape, "zero1", {})
    assert axes[0] == () and "pipeline" in {a for ax in axes for a in ax}
    assert all("fsdp" not in ax for ax in axes)


def test_zero1_copy_outside_the_pipeline_is_whole_over_the_stages():
    """Stored over the stages (rules embed: [fsdp, pipeline]): a param outside the stacks
    (the LM head) and a stack the pipeline does not run (staged False: a dense prefix) get a
    zero1 copy replicated over them, as over fsdp (else gathered at every outer row group);
    a pipelined stack keeps them."""
    rules = {"embed": ["fsdp", "pipeline"], "vocab": ["tensor"], "layers": ["pipeline"],
             "stage": ["pipeline"]}
    sizes = {"data": 1, "fsdp": 2, "pipeline": 2, "expert": 1, "tensor": 1}
    head = compute_axes(("embed", "vocab"), rules, sizes, (64, 256), "zero1", {})
    dense = ("layers", "embed", "mlp")
    unstaged = compute_axes(dense, rules, sizes, (3, 64, 32), "zero1", {}, staged=False)
    staged = compute_axes(dense, rules, sizes, (3, 64, 32), "zero1", {}, staged=True)
    assert head == [(), ()] and unstaged == [(), (), ()]
    assert "pipeline" in {a for ax in staged for a in ax}


@pytest.mark.parametrize("weights", ["zero1", "hsdp"])
def test_state_is_placed_alike_in_every_mode(weights):
    overrides = LAYOUTS["pipeline2_expert2_fsdp2"]
    cfg, origins = small_config(*overrides)
    other, _ = small_config(*overrides, f"mesh.weights={weights}")
    sizes = validate(cfg, 8, origins)
    mesh = make_mesh(sizes, jax.devices()[:8])
    assert state_layout(cfg, mesh).shardings == state_layout(other, mesh).shardings


def test_checkpoint_saved_under_zero3_resumes_under_zero1(tmp_path):
    """A state saved by a zero3 run restores into a zero1 trainer (its own abstract state) and
    the next step there equals the zero3 run's next step: loss within 1e-5 relative, params
    within rtol 1e-4 / atol 1e-6 (float32 compute; only the order of sums differs)."""
    overrides = [*ACCUM, *LAYOUTS["data2_fsdp2_expert2"]]
    cfgs = {w: small_config(*overrides, f"mesh.weights={w}") for w in ("zero3", "zero1")}
    cfg, origins = cfgs["zero3"]
    sizes = validate(cfg, 8, origins)
    mesh = make_mesh(sizes, jax.devices()[:8])
    trainers = {w: make_trainer(cfg, mesh) for w, (cfg, _) in cfgs.items()}
    batch = jax.device_put(random_batch(cfg), trainers["zero3"].batch_sharding)
    state = trainers["zero3"].init()
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1)) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        restored, _ = ckpt.restore(trainers["zero1"].abstract_state)
    after = {"zero3": trainers["zero3"].step(state, batch),
             "zero1": trainers["zero1"].step(restored, batch)}
    (s3, m3), (s1, m1) = jax.device_get(after["zero3"]), jax.device_get(after["zero1"])
    np.testing.assert_allclose(m1["loss"], m3["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s3["params"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_zero1_copy_holds_a_replica_of_each_stack_per_data_parallel_group():
    """The copy of a stacked param is [G, L, ...], G = data x fsdp groups, split over them
    (parallel/replicas.py runs the stacks over the replicas); the other params are not."""
    cfg, origins = small_config(*ACCUM, *LAYOUTS["data2_fsdp2_expert2"], "mesh.weights=zero1")
    sizes = validate(cfg, 8, origins)
    mesh = make_mesh(sizes, jax.devices()[:8])
    copy = state_layout(cfg, mesh).compute
    assert copy.replicas == 4
    stacked = jax.tree.leaves(copy.stacked)
    assert any(stacked) and not all(stacked)  # the layer stacks; the embedding, head, norm
    for s, sharding in zip(stacked, jax.tree.leaves(copy.shardings), strict=True):
        assert (tuple(sharding.spec)[:1] == (("data", "fsdp"),)) == bool(s)
        assert s in (0, 4)


def test_zero1_copy_holds_expert_group_replicas_of_the_non_expert_stacks():
    """The copy of a stacked param other than the routed experts' is [G, L, Ge, ...], Ge the
    expert-axis groups, split over them (replicas.py on_sublayer_replicas runs attention,
    norms, router and shared experts over them); the routed experts' stay [G, L, E, ...]."""
    cfg, origins = small_config(*ACCUM, *LAYOUTS["data2_fsdp2_expert2"], "mesh.weights=zero1")
    mesh = make_mesh(validate(cfg, 8, origins), jax.devices()[:8])
    copy = state_layout(cfg, mesh).compute
    assert copy.sublayer_groups == ("expert",) and copy.sublayer_replicas == 2
    sub, stacked = jax.tree.leaves(copy.sublayer), jax.tree.leaves(copy.stacked)
    assert any(sub)
    for s, st, sharding in zip(sub, stacked, jax.tree.leaves(copy.shardings), strict=True):
        spec = tuple(sharding.spec)
        if s:  # [G, L, Ge, ...]: split over the groups, then the expert axis
            assert spec[:1] == (("data", "fsdp"),) and spec[2] in ("expert", ("expert",)), spec
        else:  # not stacked, or the routed experts' (split over the expert axis themselves)
            assert not st or "expert" in spec[2:], spec


def test_zero1_copy_holds_stage_spanning_replicas_of_a_stack_outside_the_pipeline():
    """The copy of the dense layers the pipeline does not run is [G', L, ...], G' = the fsdp x
    expert x pipeline groups (its rows are split over the stages there too: the leading
    batch axes), with no expert-group dim; the pipelined MoE stack's stays [G, L, Ge, ...]
    over fsdp alone (its stage axis holds the stages)."""
    cfg, origins = small_config(*ACCUM, *LAYOUTS["pipeline2_outer_rows"], "mesh.weights=zero1")
    mesh = make_mesh(validate(cfg, 8, origins), jax.devices()[:8], dcn=dcn_sizes(cfg))
    copy = state_layout(cfg, mesh).compute
    assert copy.groups == ("fsdp",) and copy.unpiped == (("fsdp", "expert", "pipeline"), ())
    dense, moe = copy.stacked["layer_groups"][0], copy.stacked["layer_groups"][1]
    assert set(jax.tree.leaves(dense)) == {8} and set(jax.tree.leaves(moe)) == {2}
    assert not any(jax.tree.leaves(copy.sublayer["layer_groups"][0]))
    for sharding in jax.tree.leaves(copy.shardings["layer_groups"][0]):
        assert tuple(sharding.spec)[:2] == (("fsdp", "expert", "pipeline"), None), sharding
    for sharding in jax.tree.leaves(copy.shardings["layer_groups"][1]):
        assert tuple(sharding.spec)[:2] == ("fsdp", "pipeline"), sharding


@pytest.mark.parametrize("fp8, seq, stacks", [("tensorwise", 128, False),
                                               ("blockwise", 32, False), ("blockwise", 128, True)])
def test_zero1_copy_replicas_under_fp8(fp8, seq, stacks):
    """precision.fp8: the layers' copy holds replicas only where each replica's FP8 GEMMs
    compute as the whole batch's (gradients.fp8_tiles_in_rows): blockwise with every
    128-token weight-gradient tile inside one row (seq_len % 128 == 0). Not tensorwise (its
    amax would span one group's rows) nor blockwise at seq 32 (a tile would span rows of two
    groups). The LM head and final norms (no FP8 GEMM) keep their outer replicas in all."""
    overrides = [*ACCUM, *LAYOUTS["data2_fsdp2_expert2"], "mesh.weights=zero1", *OUTER]
    cfg, origins = small_config(*overrides, f"precision.fp8={fp8}", f"data.seq_len={seq}")
    sizes = validate(cfg, 8, origins)
    copy = state_layout(cfg, make_mesh(sizes, jax.devices()[:8])).compute
    assert (copy.replicas == 4 and copy.groups == ("data", "fsdp")) if stacks else \
        (copy.replicas == 1 and copy.groups == () and not any(jax.tree.leaves(copy.stacked)))
    assert copy.outer_groups == ("data", "fsdp", "expert") and any(jax.tree.leaves(copy.outer))


def test_zero1_fp8_blockwise_replicas_match_zero3():
    """Blockwise FP8 at seq 128: zero1, its layers on replicas over data x fsdp and the LM
    head on outer replicas, against zero3 on the same 8 devices and batch (the FP8 path that
    runs on the whole batch; tests/kernels/test_fp8.py compares it with one device): loss
    within 1e-5 relative, gradients to the equivalence matrix's rtol 1e-4 / atol 1e-6 (the
    quantisation tiles are the same, only float32 sums are ordered differently). With the
    replicas forced on at seq 32 or under tensorwise it fails (a tile or amax spans rows of
    two groups: hundreds of gradient elements off by up to 5% of their leaf's largest)."""
    overrides = [*ACCUM, *LAYOUTS["data2_fsdp2_expert2"], "precision.fp8=blockwise",
                 "data.seq_len=128"]
    cfg, _ = small_config(*overrides)
    batch = random_batch(cfg)
    ref_loss, ref_grads = gradients([*overrides, "mesh.weights=zero3"], batch, 8)
    loss, grads = gradients([*overrides, "mesh.weights=zero1"], batch, 8)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_grads_close(grads, ref_grads)


def test_zero1_copy_holds_batch_group_replicas_of_the_head_and_final_norms():
    """The copy of the LM head and final norms (the main one and MTP's) is [Go, ...], Go the
    groups of every batch axis (data x fsdp x expert), split over them (the LM loss runs
    vmapped over them: replicas.py on_outer_replicas); no other param is."""
    overrides = [*ACCUM, *LAYOUTS["data2_fsdp2_expert2"], "mesh.weights=zero1", *OUTER]
    cfg, origins = small_config(*overrides)
    copy = state_layout(cfg, make_mesh(validate(cfg, 8, origins), jax.devices()[:8])).compute
    assert copy.outer_groups == ("data", "fsdp", "expert") and copy.outer_replicas == 8
    found = {jax.tree_util.keystr(path): tuple(s.spec) for (path, o), s in zip(
        jax.tree_util.tree_leaves_with_path(copy.outer), jax.tree.leaves(copy.shardings),
        strict=True) if o}
    groups = (("data", "fsdp", "expert"),)
    assert found == {"['lm_head']": (*groups, None, None), "['final_norm']['scale']": (*groups, None),
                     "['mtp'][0]['final_norm']['scale']": (*groups, None)}, found
