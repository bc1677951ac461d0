"""Every sharded layout computes the same first-step loss, metrics and gradients as one device.

Reference: the same model, initial state and batch on a single CPU device, float32. Tolerance:
loss within 1e-5 relative; every gradient within rtol 1e-4, atol 1e-6 (observed ~3e-8: only
the order of float32 reductions differs between layouts); the maximum expert load and the
dropped fraction exactly (they are counts).

Models: a small GQA / softmax top-2 model; a DeepSeek-V3-style variant (MLA, sigmoid scores
with group-limited routing, routed scaling, a random selection bias, the sequence-wise balance
loss, one MTP module); capacity dispatch with a factor that drops assignments, against one
device dropping the same ones (capacity slots are counted per sequence, so the drops do not
depend on the layout).

FP8 (precision.fp8, float32 compute; FP8_LAYOUTS): every layout of LAYOUTS and an MLA layout
in both modes, a pipeline layout blockwise, against one device in the same mode: the first
step's loss (the forward alone: the backward's compile would double the cost) within
FP8_LOSS_RTOL, the expert loads exactly. Both modes are exact up to float32 order. Blockwise:
its scales are per row (1x128) or per weight block, and every block lies on one shard (FP8 sets
the routed experts 128 x tensor wide). Tensorwise: every scale is the whole tensor's amax,
global under GSPMD (dense projections) and reduced over the shard_map's axes in the grouped
experts (kernels/fp8.AmaxAxes). The gradients are not compared: the weight gradients' 128x1
token tiles follow each layout's rows. FP8 dispatch: wherever tokens travel to their experts
(all_gather, all_to_all, capacity) they go as E4M3 1x128 tiles, and where they do not (one
device) they are rounded in place the same way (kernels/fp8.e4m3_wire), so these rows stay
exact up to float32 order; without the wire's rounding on the sharded side the tensorwise
all_to_all row was 2.2e-6 off (blockwise 8.6e-8: its GEMM rounds the rows to the same values).

Pipeline layouts split the batch into microbatches. Their runs keep every router loss on, at
weights large enough to move the router gradients past the tolerance if a loss were formed per
microbatch: the Switch balance loss is built from the batch's summed load and mean affinity,
the sequence-wise loss and the z-loss are means of per-row / per-token terms
(model/router.py), so pipelined and unpipelined steps optimise the same loss.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from maxmoe.model.spec import layer_groups
from maxmoe.model.transformer import build_model
from maxmoe.parallel import capacity, dispatch
from maxmoe.parallel.pipeline import num_stages
from maxmoe.parallel.schedule import pipeline_schedule
from maxmoe.sharding import make_mesh, named, state_shardings, use_mesh
from maxmoe.validation import validate
from tests.helpers import assert_grads_close, loss_and_grads, random_batch, small_config

LAYOUTS = {
    "data8": ["mesh.data=8"],
    "fsdp8": ["mesh.fsdp=8"],
    "expert8": ["mesh.expert=8"],
    "data2_fsdp2_expert2": ["mesh.fsdp=2", "mesh.expert=2"],
    "fsdp2_expert2_tensor2": ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"],
    "data4_tensor2": ["mesh.tensor=2"],
    "expert4_tensor2": ["mesh.expert=4", "mesh.tensor=2"],
}
PIPELINE = ["model.num_layers=5",  # 1 dense + 4 MoE layers; every router loss on
            "moe.aux_loss_weight=0.1", "moe.z_loss_weight=0.01",
            "moe.sequence_balance_loss_weight=0.1"]
PIPELINE_LAYOUTS = {
    "pipeline2_data4": ["mesh.pipeline=2"],
    "pipeline4_data2": ["mesh.pipeline=4"],
    "pipeline2_expert2_fsdp2_gpipe4": ["mesh.pipeline=2", "mesh.expert=2", "mesh.fsdp=2",
                                       "model.pipeline_microbatches=4"],
    "pipeline2_tensor2_circular": ["mesh.pipeline=2", "mesh.tensor=2",
                                   "model.pipeline_schedule=circular"],
    # unequal stages: 3 + 1 MoE layers, the second stage padded with two identity slots
    "pipeline2_expert2_fsdp2_layers31": ["mesh.pipeline=2", "mesh.expert=2", "mesh.fsdp=2",
                                         "model.pipeline_stage_layers=[3,1]"],
    # circular with more microbatches than stages (outputs wait for stage 0's next pass)
    "pipeline2_circular_micro4": ["mesh.pipeline=2", "model.pipeline_schedule=circular",
                                  "model.pipeline_microbatches=4"],
}
# capacity mode with factor = num_experts has a slot for every assignment: nothing is dropped,
# so it must equal the dropless single-device reference too
DISPATCH = {"dropless": [], "capacity": ["moe.dispatch=capacity", "moe.capacity_factor=8.0"],
            "all_to_all": ["moe.transport=all_to_all"]}
# dropless over the all-to-all transport (auto picks all_gather on these 8 devices): a few
# expert layouts, each case a compile; the default buffer factor runs 1 or 2 rounds here
ALL_TO_ALL = ("expert8", "data2_fsdp2_expert2", "expert4_tensor2",
              "pipeline2_expert2_fsdp2_gpipe4")
# a factor that drops (each sequence: 8 slots per expert for its 64 assignments): the reference
# is one device with the same factor, which must drop exactly the same assignments
DROPS = ["moe.dispatch=capacity", "moe.capacity_factor=1.0"]
# ranked by router weight: its batch has no repeated neighbour tokens (random_batch's
# distinct_neighbours says why), and test_capacity_drops_match_single_device checks that no
# capacity boundary falls on a near-tie (MIN_DROP_MARGIN)
DROPS_BY_WEIGHT = [*DROPS, "moe.drop_policy=probability", "train.seed=1"]
# the smallest relative gap allowed between the router weights of an expert's last kept and
# first dropped assignment: layouts differ from one device by ~1e-7 relative (float32 order)
MIN_DROP_MARGIN = 1e-4
DROP_LAYOUTS = {  # name: (overrides, reference)
    "expert8": (LAYOUTS["expert8"] + DROPS, "drops"),
    "data2_fsdp2_expert2": (LAYOUTS["data2_fsdp2_expert2"] + DROPS, "drops"),
    "expert4_tensor2_probability": (LAYOUTS["expert4_tensor2"] + DROPS_BY_WEIGHT,
                                    "drops_by_weight"),
    "pipeline2_expert2_fsdp2_gpipe4": (
        PIPELINE + PIPELINE_LAYOUTS["pipeline2_expert2_fsdp2_gpipe4"] + DROPS, "pipeline_drops"),
}
# DeepSeek-V3 features at test size (configs/models/tiny_deepseek_v3.yaml has the same keys)
MLA = ["attention.kind=mla", "attention.num_kv_heads=4", "attention.q_lora_rank=32",
       "attention.kv_lora_rank=16", "attention.qk_nope_head_dim=16",
       "attention.qk_rope_head_dim=8", "attention.v_head_dim=16", "attention.rope_interleave=true",
       "moe.router=sigmoid", "moe.num_groups=4", "moe.groups_per_token=2",
       "moe.routed_scaling_factor=2.5", "moe.aux_loss_weight=0.0", "moe.bias_update_speed=0.001",
       "moe.sequence_balance_loss_weight=0.01", "model.mtp_depth=1"]
# the two-level transport needs MLA's group-limited routing (4 groups, 2 a token); one process
# stands in for 2 hosts: 2 x 4 devices on expert8, 2 x 1 on expert2 (moe.expert_hosts as well:
# loss_and_grads builds the model without make_trainer, whose resolve_transport reads the dcn)
TWO_LEVEL = ["moe.transport=two_level", "mesh.dcn_expert=2", "moe.expert_hosts=2"]
MLA_LAYOUTS = {
    "expert8": LAYOUTS["expert8"],
    "fsdp2_expert2_tensor2": LAYOUTS["fsdp2_expert2_tensor2"],
    "expert8_two_level": LAYOUTS["expert8"] + TWO_LEVEL,
    "fsdp2_expert2_tensor2_two_level": LAYOUTS["fsdp2_expert2_tensor2"] + TWO_LEVEL,
}
# two_level under the pipeline (its grouped exchanges inside the stages' vmap): pipeline 2 x
# expert 4, the expert axis 2 hosts x 2 devices, 4 microbatches
PIPELINE_TWO_LEVEL = ["mesh.pipeline=2", "mesh.expert=4", "mesh.data=1",
                      "model.pipeline_microbatches=4", *TWO_LEVEL]
# moe.overlap_chunks=2: each device's tokens dispatched in two independent chunks (so XLA:GPU can
# run one chunk's exchanges under the other's GEMMs), against the one-chunk reference. The one-
# round row is the layout the overlap wants (moe.transport_rounds=1, no rounds loop), with a
# buffer factor at which nothing drops; the others take the dropless rounds, the pipeline's vmap
# and two_level's hops
CHUNKS = ["moe.overlap_chunks=2"]
ONE_ROUND = ["moe.transport_rounds=1", "moe.transport_buffer_factor=4.0"]
CHUNKED_LAYOUTS = {  # name: (REFERENCES key, overrides)
    "expert8_all_to_all_one_round": ("plain", LAYOUTS["expert8"] + DISPATCH["all_to_all"]
                                     + ONE_ROUND + CHUNKS),
    "data2_fsdp2_expert2_all_to_all": ("plain", LAYOUTS["data2_fsdp2_expert2"]
                                       + DISPATCH["all_to_all"] + CHUNKS),
    "pipeline2_expert2_fsdp2_gpipe4_all_to_all": ("pipeline", PIPELINE + PIPELINE_LAYOUTS[
        "pipeline2_expert2_fsdp2_gpipe4"] + DISPATCH["all_to_all"] + CHUNKS),
    "mla_expert8_two_level": ("mla", MLA + MLA_LAYOUTS["expert8_two_level"] + CHUNKS),
}
# all four axes at once need 2 x 2 x 2 x 2 = 16 devices: run in a process of its own
SIXTEEN = ["mesh.pipeline=2", "mesh.expert=2", "mesh.tensor=2", "mesh.fsdp=2"]
REFERENCES = {"plain": [], "pipeline": PIPELINE, "drops": DROPS, "drops_by_weight": DROPS_BY_WEIGHT,
              "pipeline_drops": PIPELINE + DROPS, "mla": MLA, "capacity": DISPATCH["capacity"],
              "mla_pipeline": PIPELINE + MLA}
# precision.fp8 over the layouts (float32 compute), against one device in the same mode: the
# forward's loss and expert loads (module docstring, FP8). 2 layers (one dense, one MoE) cover
# every FP8 projection: attention, dense MLP, shared and routed experts. Routed experts 256 wide
# = 128 x tensor: each 128-wide block along F then lies whole on one tensor shard (with 32, a
# block straddles the two shards, each scaling its own half).
FP8 = ["model.num_layers=2", "moe.expert_mlp_size=256"]
FP8_LAYOUTS = {  # name: (REFERENCES key of the model, layout, modes)
    **{name: ("plain", LAYOUTS[name], ("blockwise", "tensorwise")) for name in LAYOUTS},
    # tensorwise (current scaling) scales each pipeline microbatch apart, where one device
    # scales the whole batch: a different loss by design (4.7e-5 here)
    "pipeline2_expert2_fsdp2_gpipe4": ("pipeline", PIPELINE_LAYOUTS[
        "pipeline2_expert2_fsdp2_gpipe4"], ("blockwise",)),
    # MLA: partial 128-blocks (rope key 8 wide, kv_a 16) under tensor sharding
    "mla_fsdp2_expert2_tensor2": ("mla", MLA_LAYOUTS["fsdp2_expert2_tensor2"],
                                  ("blockwise", "tensorwise")),
    # FP8 dispatch (module docstring): the all-to-all transport's rounds (3 here) and capacity
    # slots in E4M3 (the rows above send all_gather's). Tensorwise all_to_all at a buffer of
    # one round: each round is a kernel call with its own scales, where one device has one
    "expert8_all_to_all": ("plain", LAYOUTS["expert8"] + DISPATCH["all_to_all"],
                           ("blockwise",)),
    "expert8_all_to_all_one_round": ("plain", LAYOUTS["expert8"] + DISPATCH["all_to_all"]
                                     + ["moe.transport_buffer_factor=4.0"], ("tensorwise",)),
    "data2_fsdp2_expert2_capacity": ("capacity", LAYOUTS["data2_fsdp2_expert2"]
                                     + DISPATCH["capacity"], ("blockwise", "tensorwise")),
}
# seen at most 8.6e-8 (both modes; tensorwise 3.6e-6 and 7.4e-5 on MLA while the grouped
# experts scaled each kernel step's local rows); FP8 itself moves this loss by 7.0e-5
# (blockwise) and 1.2e-4 (tensorwise) from fp8 none, so a layout that skipped it fails
FP8_LOSS_RTOL = {"blockwise": 1e-6, "tensorwise": 1e-6}


def with_router_bias(params):
    """params with every router selection bias [..., E] set to seeded noise (a bias of zeros
    would let a layout that ignores or misplaces it pass); its spread is that of the scores."""
    rng = np.random.default_rng(1)

    def noisy(path, leaf):
        if getattr(path[-1], "key", None) != "bias":
            return leaf
        return rng.normal(0.0, 0.02, np.shape(leaf)).astype(np.float32)
    return jax.tree_util.tree_map_with_path(noisy, params)


def reference_of(overrides):
    """(batch, one-device (loss, metrics, grads)) of a config."""
    cfg, origins = small_config(*overrides)
    batch = random_batch(cfg, distinct_neighbours=cfg.moe.drop_policy == "probability")
    return batch, loss_and_grads(cfg, origins, batch, num_devices=1, edit=with_router_bias)


@pytest.fixture(scope="module")
def references():
    """name -> reference_of(REFERENCES[name]), each computed on first use."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = reference_of(REFERENCES[name])
        return cache[name]
    return get


def check(overrides, reference, num_devices=8):
    """Asserts the layout's loss, metrics and gradients equal the reference's; returns the
    config and its origins."""
    batch, (ref_loss, ref_metrics, ref_grads) = reference
    cfg, origins = small_config(*overrides)
    loss, metrics, grads = loss_and_grads(cfg, origins, batch, num_devices=num_devices,
                                          edit=with_router_bias)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_array_equal(metrics["expert_load_max"], ref_metrics["expert_load_max"])
    np.testing.assert_array_equal(metrics["dropped_fraction"], ref_metrics["dropped_fraction"])
    # per MoE layer: the same rows in the same order (pipeline: natural layer order)
    np.testing.assert_array_equal(metrics["expert_load"], ref_metrics["expert_load"])
    np.testing.assert_array_equal(metrics["dropped_fraction_by_layer"],
                                  ref_metrics["dropped_fraction_by_layer"])
    np.testing.assert_allclose(metrics["router_entropy"], ref_metrics["router_entropy"],
                               rtol=1e-5)
    # per MoE layer: pipelined, the root of the microbatches' mean square (a plain mean of
    # their RMS values was 8.9e-5 apart on pipeline2_data4)
    np.testing.assert_allclose(metrics["activation_rms"], ref_metrics["activation_rms"],
                               rtol=1e-5)
    assert_grads_close(grads, ref_grads)
    return cfg, origins


def assert_pipelined(cfg, origins, num_devices=8):
    """The MoE group really ran pipelined (not replicated on every stage)."""
    sizes = validate(cfg, num_devices, origins)
    with use_mesh(make_mesh(sizes, jax.devices()[:num_devices]), cfg.mesh.rules):
        schedule = pipeline_schedule(cfg.model, num_stages())  # the stages the model reads
    assert [schedule.pipelines(n) for _, _, n in layer_groups(cfg.model)] == [False, True]


def _cases(layouts):
    return [(name, dispatch) for name in layouts for dispatch in DISPATCH
            if dispatch != "all_to_all" or name in ALL_TO_ALL]


@pytest.mark.parametrize("name, dispatch", _cases(LAYOUTS))
def test_layout_matches_single_device(name, dispatch, references):
    check(LAYOUTS[name] + DISPATCH[dispatch], references("plain"))


@pytest.mark.parametrize("name, dispatch", _cases(PIPELINE_LAYOUTS))
def test_pipeline_layout_matches_single_device(name, dispatch, references):
    cfg, origins = check(PIPELINE + PIPELINE_LAYOUTS[name] + DISPATCH[dispatch],
                         references("pipeline"))
    assert_pipelined(cfg, origins)


@pytest.mark.parametrize("name", list(DROP_LAYOUTS))
def test_capacity_drops_match_single_device(name, references, monkeypatch):
    """Capacity mode that really drops: the same assignments as on one device (the same
    dropped fraction, loss and gradients), whatever the layout or pipeline microbatching."""
    overrides, ref_name = DROP_LAYOUTS[name]
    reference = references(ref_name)
    assert reference[1][1]["dropped_fraction"] > 0.0
    if "moe.drop_policy=probability" in overrides:
        margin = drop_margin(REFERENCES[ref_name], reference[0], monkeypatch)
        assert margin > MIN_DROP_MARGIN, (
            f"a capacity boundary falls on a router-weight near-tie (relative gap {margin:.1e}):"
            " which assignment drops would depend on float32 rounding, not on the layout")
    cfg, origins = check(overrides, reference)
    if cfg.mesh.pipeline > 1:
        assert_pipelined(cfg, origins)


@pytest.mark.parametrize("name", list(MLA_LAYOUTS))
def test_deepseek_v3_features_match_single_device(name, references):
    """MLA, sigmoid group-limited routing with a selection bias, routed scaling, the sequence
    balance loss and MTP, sharded over expert, fsdp and tensor axes."""
    check(MLA + MLA_LAYOUTS[name], references("mla"))


@pytest.mark.parametrize("remat", ["full", "save_received"])
def test_two_level_under_the_pipeline_matches_single_device(remat, references):
    """moe.transport=two_level inside the pipeline's stages, with the MLA model's group-limited
    routing and every router loss on; save_received keeps hop 1's received rows for the
    backward instead of sending them again (the reference: one device, remat full)."""
    cfg, origins = check(PIPELINE + MLA + PIPELINE_TWO_LEVEL + [f"model.remat_policy={remat}"],
                         references("mla_pipeline"))
    assert cfg.model.remat_policy == remat
    assert_pipelined(cfg, origins)


@pytest.mark.parametrize("name", list(CHUNKED_LAYOUTS))
def test_chunked_overlap_matches_single_device(name, references, monkeypatch):
    """moe.overlap_chunks=2 (parallel/dispatch.Chunked): the same loss, metrics and gradients
    as one device with one chunk, at the table's tolerances; the chunks really ran."""
    ref_name, overrides = CHUNKED_LAYOUTS[name]
    reference = references(ref_name)  # one chunk: built before Chunked is watched
    calls, chunked = [], dispatch.Chunked.__call__
    monkeypatch.setattr(dispatch.Chunked, "__call__",
                        lambda self, *a: calls.append(self.chunks) or chunked(self, *a))
    cfg, origins = check(overrides, reference)
    assert calls and set(calls) == {2}
    if cfg.mesh.pipeline > 1:
        assert_pipelined(cfg, origins)


def first_loss(overrides, batch, num_devices: int):
    """(loss, metrics) of a config's first step on the first num_devices devices: the forward
    alone (loss_and_grads without the backward, whose compile would double the cost)."""
    cfg, origins = small_config(*overrides)
    mesh = make_mesh(validate(cfg, num_devices, origins), jax.devices()[:num_devices])
    graphdef, variables = nnx.split(build_model(cfg, cfg.train.seed))
    params = with_router_bias(nnx.to_pure_dict(variables))
    shardings = nnx.to_pure_dict(state_shardings(variables, mesh, cfg.mesh.rules))
    with use_mesh(mesh, cfg.mesh.rules):
        params = jax.device_put(params, shardings)
        batch = jax.device_put(batch, named(("batch", "seq")))
        out = jax.jit(lambda p, b: nnx.merge(graphdef, p).loss(b))(params, batch)
    return jax.device_get(out)


def drop_margin(overrides, batch, monkeypatch) -> float:
    """The smallest relative gap, over every sequence, expert and MoE layer of one device's
    forward, between the router weights of the last assignment an expert keeps and the first
    it drops (capacity_slots' inputs, recorded as the forward runs)."""
    seen = []
    ranked = capacity.capacity_slots

    def recording(expert_idx, weights, num_experts, slots, drop_policy):
        jax.debug.callback(lambda i, w: seen.append((np.asarray(i), np.asarray(w))),
                           expert_idx, weights)
        return ranked(expert_idx, weights, num_experts, slots, drop_policy)
    monkeypatch.setattr(capacity, "capacity_slots", recording)
    cfg, _ = small_config(*overrides)
    slots = capacity.capacity_for(cfg.data.seq_len, cfg.moe)
    first_loss(overrides, batch, 1)
    gaps = [np.inf]
    for expert_idx, weights in seen:
        for e in range(cfg.moe.num_experts):
            w = np.sort(weights[expert_idx == e])[::-1]
            if len(w) > slots:
                gaps.append((w[slots - 1] - w[slots]) / w[slots - 1])
    return float(min(gaps))


def fp8_overrides(model: str, mode: str) -> list[str]:
    """The overrides of an FP8 case: FP8's shape, then REFERENCES[model] (pipeline: 5 layers)."""
    return [*FP8, *REFERENCES[model], f"precision.fp8={mode}"]


@pytest.fixture(scope="module")
def fp8_references():
    """(model, mode) -> (batch, one-device (loss, metrics)), each computed on first use."""
    cache = {}

    def get(model, mode):
        if (model, mode) not in cache:
            cfg, _ = small_config(*fp8_overrides(model, mode))
            batch = random_batch(cfg)
            cache[model, mode] = batch, first_loss(fp8_overrides(model, mode), batch, 1)
        return cache[model, mode]
    return get


@pytest.mark.parametrize("name, mode", [(name, mode) for name, (_, _, modes) in
                                        FP8_LAYOUTS.items() for mode in modes])
def test_fp8_layout_matches_single_device(name, mode, fp8_references):
    """precision.fp8 on every layout of LAYOUTS, a pipeline and an MLA one: the loss of one
    device in the same mode within FP8_LOSS_RTOL[mode], the expert loads exactly."""
    model, layout, _ = FP8_LAYOUTS[name]
    batch, (ref_loss, ref_metrics) = fp8_references(model, mode)
    loss, metrics = first_loss(fp8_overrides(model, mode) + layout, batch, 8)
    print(f"\nFP8 {mode} {name} loss rel {abs(loss - ref_loss) / ref_loss:.2e}")
    np.testing.assert_allclose(loss, ref_loss, rtol=FP8_LOSS_RTOL[mode])
    np.testing.assert_array_equal(metrics["expert_load"], ref_metrics["expert_load"])


def compare_on(num_devices: int, overrides: list[str], reference: list[str]):
    """Entry point of the 16-device subprocess: reference and layout in one process, which
    must have at least num_devices devices."""
    assert len(jax.devices()) >= num_devices, jax.devices()
    cfg, origins = check(overrides, reference_of(reference), num_devices=num_devices)
    assert_pipelined(cfg, origins, num_devices)
    print("equal on", num_devices, "devices")


@pytest.mark.slow
def test_pipeline_expert_tensor_fsdp_on_16_devices():
    """pipeline 2 x expert 2 x tensor 2 x fsdp 2 (the test process has only 8 fake devices)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = dict(os.environ, XLA_FLAGS=" ".join([*flags, "--xla_force_host_platform_device_count=16"]),
               JAX_PLATFORMS="cpu")
    code = ("from tests.test_sharded_equivalence import PIPELINE, SIXTEEN, compare_on\n"
            "compare_on(16, PIPELINE + SIXTEEN, PIPELINE)")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "equal on 16 devices" in proc.stdout
