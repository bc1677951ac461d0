"""The pre-ranker's analytic model of one layout (plan/search.py enumerates the layouts and
ranks them by it, so only the promising ones are compiled).

A `Layout` is mesh axis sizes, their host (DCN) split, the remat policy and the gradient
accumulation microbatches. Its `estimate` is state bytes from the abstract shardings
(estimate.py, exact) plus an activation model calibrated against compiles, and a step time
from the roofline with communication bytes counted per axis from the layout (compiled plans
read them from HLO); `routed_dispatch_bytes` is also what compiled plans price the expert
exchange at.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from maxmoe.cluster import Cluster, gpu_target
from maxmoe.config import MESH_AXES, Config
from maxmoe.metrics.flops import (
    flops_by_kernel,
    flops_per_token,
    pipelined_share,
    recompute_factor,
)
from maxmoe.model.spec import layer_groups, pipeline_idle
from maxmoe.parallel.capacity import capacity_for
from maxmoe.parallel.dispatch import choose_transport
from maxmoe.parallel.schedule import pipeline_schedule
from maxmoe.plan.roofline import (
    DEFAULT_LOAD_IMBALANCE,
    hosts_reached,
    price_compute,
    routed_all_to_all_bytes,
    step_time,
)
from maxmoe.validation import shards, stage_batch_shards


@dataclasses.dataclass(frozen=True)
class Layout:
    """One candidate: mesh sizes, DCN factors, remat policy and accumulation microbatches."""
    sizes: dict[str, int]
    dcn: dict[str, int]
    remat: str
    microbatches: int
    weights: str = "zero3"  # mesh.weights

    def overrides(self) -> list[str]:
        """The KEY=VALUE overrides that select this layout."""
        mesh = [f"mesh.{a}={self.sizes[a]}" for a in MESH_AXES]
        dcn = [f"mesh.dcn_{a}={self.dcn[a]}" for a in MESH_AXES]
        return [*mesh, *dcn, f"mesh.weights={self.weights}",
                f"model.remat_policy={self.remat}", f"train.grad_accum_steps={self.microbatches}"]

    def apply(self, cfg: Config) -> Config:
        mesh = dataclasses.replace(cfg.mesh, **self.sizes, weights=self.weights,
                                   **{f"dcn_{a}": n for a, n in self.dcn.items()})
        return dataclasses.replace(
            cfg, mesh=mesh, model=dataclasses.replace(cfg.model, remat_policy=self.remat),
            train=dataclasses.replace(cfg.train, grad_accum_steps=self.microbatches))


# Activation model of the pre-ranker: bytes per device of the step's temporaries beyond the
# gradients, as multiples of one layer's residual stream [tokens per device, D] in the compute
# dtype. The factors are fitted to compiles (tests/plan/test_search.py states the error).
SAVED_PER_LAYER = {"full": 1.0, "save_named": 4.0, "dots": 10.0, "offload_named": 1.0,
                   "save_received": 5.0,  # + hop 1's [H, T, D] rows, H <= groups_per_token
                   "none": 14.0}
LOGITS_COPIES = 7  # [tokens, vocab / tensor] float32: logits, softmax, their gradients
# [vocab, D / tensor] float32 tables: the embedding's and LM head's float32 compute copies,
# the embedding gather's and the head's gradients and their partial sums (8 such buffers of
# 3.45 GiB each in the 671B compile at ep64 x fsdp32: docs/performance/planning.md, Scale memory)
VOCAB_TABLE_COPIES = 8
# zero1 / hsdp: the compute copy and its float32 sums are counted apart (copy_elements); what
# remains are the embedding gather's and the LM head's float32 gradients inside the loop
ZERO1_VOCAB_TABLE_COPIES = 2
# a pipelined run keeps its stage inputs, [iterations, B/M, S, D], once: the loop's own
# backward (parallel/pipeline_loop.Loop) reads the forward's buffer (the 671B recipe's XLA:GPU
# compile: one 13.07 GiB buffer of 239 iterations' inputs; two under jax's autodiff of the
# loop: docs/performance/planning.md, "The search's pre-ranker")
PIPELINE_INPUT_COPIES = 1
UPDATE_COPIES = 2  # of the largest parameter leaf: gradient accumulation over the layer scan


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A layout's analytic figures: state bytes (exact), temporaries (modelled), peak, the
    roofline step time with modelled communication, and whether it fits."""
    layout: Layout
    state: int
    temporaries: int
    peak: int
    step_s: float
    fits: bool


def compute_bytes(cfg: Config) -> int:
    """Bytes of one element in the compute dtype (activations, gathered weights)."""
    return np.dtype(jnp.dtype(cfg.precision.compute_dtype)).itemsize


def tokens_per_device(cfg: Config, sizes: dict[str, int], microbatches: int) -> float:
    """Rows x sequence one device processes per microbatch in the (pipelined) layers: the
    batch split over its shards, but the stage axes (validation.stage_batch_shards)."""
    return cfg.data.global_batch_size * cfg.data.seq_len / stage_batch_shards(cfg, sizes) / microbatches


def transport(cfg: Config, layout: Layout) -> str:
    """How the layout moves MoE tokens: "capacity", or the dropless transport `auto` picks
    (parallel/dispatch.py), "all_gather" or "all_to_all"."""
    if cfg.moe.dispatch == "capacity":
        return "capacity"
    return choose_transport(cfg.moe, layout.sizes["expert"], layout.dcn["expert"])


def moe_rows(cfg: Config, layout: Layout, t: float) -> float:
    """Rows one device's expert shard receives per MoE layer for `t` local tokens: the expert
    axis's every token (all_gather), c T K slots (all_to_all at buffer factor c), or capacity
    mode's [E, C] slot buffer (C = capacity_for's slots per sequence x the t / seq_len local
    sequences, parallel/capacity.py)."""
    e, ep = cfg.moe, layout.sizes["expert"]
    how = transport(cfg, layout)
    if how == "all_gather":
        return t * ep
    if how == "capacity":
        return e.num_experts * t / cfg.data.seq_len * capacity_for(cfg.data.seq_len, e)
    return e.transport_buffer_factor * t * e.experts_per_token


# exchanges of the T K assignment rows per MoE layer by the all_to_all transport: dispatch and
# combine forward; its rounds' custom VJP re-sends both, then the two gradient exchanges
# (parallel/all_to_all.py). Remat adds none: the compiled all-to-all bytes of configs/tiny.yaml
# at expert 8 are the same under remat none and full, 6.0 x c T K D rows x 3 MoE layers.
ALL_TO_ALL_EXCHANGES = 6
# of those, the dispatch forward and its re-send travel in E4M3 with one float32 scale per 128
# elements under precision.fp8 (kernels/fp8.e4m3_wire); the combine and the gradients in the
# compute dtype. Tiny's compiled all-to-all fell by two exchanges' worth
# (docs/performance/precision-and-fp8.md,
# "FP8 dispatch")
FP8_DISPATCH_EXCHANGES = 2
FP8_WIRE_BYTES = 1 + 4 / 128


# two_level's hop 1 exchanges of the token rows per MoE layer: dispatch and combine forward and
# their two gradients, and the dispatch again each time the backward re-runs the layer's
# forward (the combine's re-run is dead code), but model.remat_policy save_received, which
# keeps what hop 1 received. A pipelined layer is re-run by its stage's re-run too (but the
# last slot) and that re-run's combine feeds the next slot (metrics.flops.pipelined_reruns).
# Compiled by XLA:GPU (tests/plan/test_gpu_pipeline_reruns.py) and XLA:CPU
# (tests/parallel/test_two_level.py), hop 1's cross-host bytes are exactly that many buffers of
# token rows, plus the small router-weight and expert-id exchanges
# (docs/performance/planning.md, "two_level priced at routed bytes")
HOP1_FORWARD_AND_GRADIENTS = 4


def hop1_reruns(remat: str, slots: int) -> tuple[float, float]:
    """(times the backward sends a MoE layer's hop-1 dispatch again, its combine again), per
    layer of a pipeline stage of `slots` slots (0: not pipelined), as compiled
    (tests/plan/test_gpu_pipeline_reruns.py, tests/parallel/test_two_level.py): unpipelined 1
    and 0 under a remat policy (0 and 0 under none or save_received); pipelined, the slots but
    the last run forward once more in the backward ((S - 1) / S of each: under full one
    iteration ahead, parallel/pipeline_loop.Loop; else in the iteration's one forward, whose last
    slot's combine output is not needed), and each block's re-run re-sends its dispatch but
    under none and save_received: 1 + (S - 1) / S and (S - 1) / S then, 1 and (S - 1) / S
    under those two. Left out: under full the last backward iteration's pass ahead, read by
    none (2 (S - 1) row buffers a step)."""
    resend = float(remat not in ("none", "save_received"))
    if not slots:
        return resend, 0.0
    stage = (slots - 1) / slots
    return (stage + 1.0 if resend else 1.0), stage


def hop1_exchanges(dispatch_reruns: float, combine_reruns: float) -> tuple[float, float]:
    """(hop-1 row exchanges per MoE layer, how many of them are dispatches: FP8 on the wire
    under precision.fp8; the combines and gradients travel in the compute dtype)."""
    return HOP1_FORWARD_AND_GRADIENTS + dispatch_reruns + combine_reruns, 1 + dispatch_reruns


def routed_dispatch_bytes(cfg: Config, sizes: dict[str, int], dcn: dict[str, int]
                          ) -> dict[str, float] | None:
    """The {"ici", "dcn"} bytes one device's expert dispatch and combine send per step under
    balanced routing (`sizes` the layout, `dcn` its DCN factors); None for the transports whose
    compiled bytes are what they send (all_gather, capacity) or an expert axis of 1. The tokens
    are a device's stage batch shard; the MTP depths count as stack layers (exact without a
    pipeline). The backward's re-run of a layer's forward (model.remat_policy, a pipeline's
    per-iteration remat) sends its dispatch again, and in a pipeline stage's slots but the
    last its combine too (`hop1_reruns`; all_to_all: both).
    - all_to_all: roofline.routed_all_to_all_bytes, ALL_TO_ALL_EXCHANGES exchanges.
    - two_level: hop 1 sends each token once to each other host its experts lie on
      (roofline.hosts_reached), `hop1_exchanges` times, all across hosts; hop 2 is
      all_to_all's exchanges over one host's shards, inside it.
    Under precision.fp8 the dispatch exchanges (all_to_all: FP8_DISPATCH_EXCHANGES; hop 1:
    `hop1_exchanges`' dispatches) count FP8_WIRE_BYTES an element."""
    e, m, ep = cfg.moe, cfg.model, sizes["expert"]
    how = "capacity" if e.dispatch == "capacity" else choose_transport(e, ep, dcn["expert"])
    if ep == 1 or how not in ("all_to_all", "two_level"):
        return None
    groups, stages = layer_groups(m), sizes["pipeline"]
    schedule = pipeline_schedule(m, stages)
    # MoE layers one device runs per step at a stage's tokens, by their forward re-runs
    # (dispatch, combine): the pipelined group, the rest (MTP depths included)
    runs = {hop1_reruns(m.remat_policy, 0): m.mtp_depth if groups[-1][0] else 0}
    for n in (n for is_moe, _, n in groups if is_moe):
        key = hop1_reruns(m.remat_policy, schedule.slots(n) if schedule.pipelines(n) else 0)
        runs[key] = runs.get(key, 0) + n / stages
    tokens = cfg.data.global_batch_size * cfg.data.seq_len / stage_batch_shards(cfg, sizes)
    hosts = (e.expert_hosts or dcn["expert"]) if how == "two_level" else dcn["expert"]
    inside = {"ici": 0.0, "dcn": 0.0}
    for (_, rerun), layers in runs.items():  # all_to_all's: the combine's rerun adds both
        exchanges = ALL_TO_ALL_EXCHANGES + 2 * rerun
        sent = routed_all_to_all_bytes(
            tokens, e.experts_per_token, m.hidden_size,
            _wire_width(cfg, exchanges, FP8_DISPATCH_EXCHANGES + rerun),
            ep if how == "all_to_all" else ep // hosts, ep // hosts, exchanges, layers)
        inside = {link: inside[link] + sent[link] for link in inside}
    if how == "all_to_all":
        return inside
    reached = hosts_reached(e.num_experts, e.experts_per_token, e.num_groups,
                            e.groups_per_token, hosts)
    rows = sum(layers * _exchange_bytes(cfg, *hop1_exchanges(*key)) for key, layers in runs.items())
    across = tokens * reached * (hosts - 1) / hosts * m.hidden_size * rows
    return {"ici": inside["ici"], "dcn": across}  # hop 2 stays inside the host


def _exchange_bytes(cfg: Config, exchanges: int, dispatches: int) -> float:
    """Bytes per element of `exchanges` exchanges together, `dispatches` of them in FP8 under
    precision.fp8."""
    return exchanges * _wire_width(cfg, exchanges, dispatches)


def _wire_width(cfg: Config, exchanges: int, dispatches: int) -> float:
    """Bytes per element averaged over `exchanges`, `dispatches` of which travel in FP8 under
    precision.fp8 (FP8_WIRE_BYTES), the rest in the compute dtype."""
    width = float(compute_bytes(cfg))
    if cfg.precision.fp8 == "none":
        return width
    return ((exchanges - dispatches) * width + dispatches * FP8_WIRE_BYTES) / exchanges


def activation_bytes(cfg: Config, layout: Layout) -> float:
    """Modelled temporaries beyond the gradients: saved residuals of every layer, one MoE
    layer's received rows (`moe_rows`) and expert intermediates, the logits and the float32
    vocabulary tables. A pipelined run of layers keeps instead its stage inputs, one
    microbatch's rows per iteration (`pipelined_bytes`); the layers outside it run on every
    batch axis's share of the rows, the LM head on one of model.outer_microbatches' groups of
    them."""
    m, sizes = cfg.model, layout.sizes
    t = tokens_per_device(cfg, sizes, layout.microbatches)
    width = compute_bytes(cfg)
    schedule = pipeline_schedule(m, sizes["pipeline"])
    piped = [n for _, _, n in layer_groups(m) if schedule.pipelines(n)]
    outside = t / sizes["pipeline"] if piped else t  # the stage axes split the rows there
    layers = m.num_layers + m.mtp_depth - sum(piped)
    if not piped:
        layers /= sizes["pipeline"]
    saved = layers * outside * m.hidden_size * width * SAVED_PER_LAYER[layout.remat]
    rows = outside / m.outer_microbatches
    moe = _moe_bytes(cfg, layout, rows if piped else t)
    if piped:
        moe = max(moe, pipelined_bytes(cfg, layout, t, sum(piped)))
    chunk = m.lm_loss_chunk or cfg.data.seq_len  # kernels/lm_loss.py: one chunk's logits
    logits = LOGITS_COPIES * rows * min(chunk / cfg.data.seq_len, 1.0) * m.vocab_size / sizes[
        "tensor"] * 4
    copies = VOCAB_TABLE_COPIES if layout.weights == "zero3" else ZERO1_VOCAB_TABLE_COPIES
    tables = copies * m.vocab_size * m.hidden_size / sizes["tensor"] * 4
    return saved + moe + logits + tables


def _moe_bytes(cfg: Config, layout: Layout, t: float) -> float:
    """One MoE layer's received rows and expert intermediates for `t` local tokens, in
    moe.overlap_chunks chunks of them at a time."""
    m, e = cfg.model, cfg.moe
    t = t / max(e.overlap_chunks, 1)
    width = compute_bytes(cfg)
    intermediates = t * e.experts_per_token * (2 * e.expert_mlp_size / layout.sizes["tensor"]
                                               + m.hidden_size) * 4
    rows = moe_rows(cfg, layout, t)
    if transport(cfg, layout) == "all_gather":
        return rows * m.hidden_size * (width + 4) + intermediates
    # send and receive buffers of the same slots, their float32 outputs
    return rows * m.hidden_size * (2 * width + 4) + intermediates * rows / (
        t * e.experts_per_token)


def pipelined_bytes(cfg: Config, layout: Layout, t: float, layers: int) -> float:
    """A pipelined run of `layers` layers (parallel/pipeline.py), `t` tokens per device per
    step's microbatch: the stage inputs kept for the backward, one pipeline microbatch's rows
    per iteration (PIPELINE_INPUT_COPIES of them, as compiled), one iteration's stage pass
    (its slots' saved residuals under model.remat_policy) and its MoE layer's buffers."""
    m = cfg.model
    schedule = pipeline_schedule(m, layout.sizes["pipeline"])
    width = compute_bytes(cfg)
    t_mb = t / schedule.microbatches
    stored = PIPELINE_INPUT_COPIES * schedule.iterations * t_mb * m.hidden_size * width
    inner = (schedule.slots(layers) * t_mb * m.hidden_size * width
             * SAVED_PER_LAYER[layout.remat])
    return stored + inner + _moe_bytes(cfg, layout, t_mb)


def gather_bytes(layout: Layout, gathered: dict[tuple[str, ...], int], width: int,
                 reads: int = 1) -> dict:
    """Elements each device receives per step when compute all-gathers the parameters stored
    over extra axes (StateBytes.gathered), by axis: the gather over a group of axes runs
    hierarchically, cross-host (DCN) axes first, where the pieces are smallest. zero3: per
    microbatch and per `reads` of the weights within one (`weight_reads`), a forward and a
    backward gather in the compute dtype and the gradient reduce-scatter in float32; zero1:
    once per step, the copy's gather and the gradients' one reduction, both in the compute
    dtype."""
    per_axis: dict[str, float] = {}
    for axes, elements in gathered.items():
        running = elements
        for axis in sorted(axes, key=lambda a: layout.dcn[a] == 1):
            per_axis[axis] = per_axis.get(axis, 0.0) + (layout.sizes[axis] - 1) * running
            running *= layout.sizes[axis]
    per_step = ((2 * width + 4) * layout.microbatches * reads if layout.weights == "zero3"
                else 2 * width)
    return {a: n * per_step for a, n in per_axis.items()}


def weight_reads(cfg: Config, layout: Layout) -> int:
    """Times one microbatch reads the layers' weights, which zero3 gathers at each read: once
    per pipeline iteration in a pipelined run (the layers its stages hold dominate), else once
    per model.outer_microbatches row group (every layer runs on each group in turn)."""
    m = cfg.model
    schedule = pipeline_schedule(m, layout.sizes["pipeline"])
    if any(schedule.pipelines(n) for _, _, n in layer_groups(m)):
        return schedule.iterations
    return m.outer_microbatches


def comm_bytes(cfg: Config, layout: Layout, state) -> dict:
    """Modelled bytes one device sends per step, per axis, in collective_bytes' shape: ZeRO-3
    gathers of the stored parameters and gradient reduce-scatters (`gather_bytes`); MoE token
    traffic per MoE layer: all_gather's gathers and reduce-scatters (forward, remat, backward),
    or all_to_all's and two_level's routed_dispatch_bytes x DEFAULT_LOAD_IMBALANCE (the busiest
    shard's share);
    tensor all-reduces."""
    m, sizes = cfg.model, layout.sizes
    t = tokens_per_device(cfg, sizes, 1)
    width = compute_bytes(cfg)
    moe_layers = sum(n for is_moe, _, n in layer_groups(m) if is_moe) + m.mtp_depth
    ep, tp = sizes["expert"], sizes["tensor"]
    sent = gather_bytes(layout, state.gathered, width, weight_reads(cfg, layout))
    if transport(cfg, layout) == "all_gather":
        tokens = 3 * (ep - 1) * t * m.hidden_size * (width + 4) * moe_layers
    else:
        routed = routed_dispatch_bytes(cfg, sizes, layout.dcn)
        tokens = (sum(routed.values()) * DEFAULT_LOAD_IMBALANCE if routed else
                  8 * (ep - 1) / ep * moe_rows(cfg, layout, t) * m.hidden_size * width * moe_layers)
    sent["expert"] = sent.get("expert", 0.0) + tokens
    sent["tensor"] = sent.get("tensor", 0.0) + (
        6 * 2 * (tp - 1) / tp * t * m.hidden_size * width * m.num_layers)
    out = {}
    for axis, n in sent.items():
        if sizes[axis] > 1 and n:
            link = "dcn" if layout.dcn[axis] > 1 else "ici"
            out[axis] = {"estimate": {"ici": 0.0, "dcn": 0.0} | {link: n}}
    return out


def dequantised_routed(cfg: Config, cluster: Cluster) -> bool:
    """Whether the routed experts' grouped GEMMs would run FP8's values in bf16 math on the
    cluster: precision.fp8 on and moe.grouped_matmul tokamax, which auto resolves to on an
    NVIDIA GPU kind (one whose file has a gpu_target): kernels/fp8_ragged.dequantised_ragged_dot."""
    return (cfg.precision.fp8 != "none" and cfg.moe.grouped_matmul in ("auto", "tokamax")
            and gpu_target(cluster.kind) is not None)


def estimate(cfg: Config, layout: Layout, cluster: Cluster, state) -> Estimate:
    """The analytic figures of one layout given its StateBytes."""
    act = activation_bytes(cfg, layout)
    temporaries = int(state.grads + act + UPDATE_COPIES * state.largest_param)
    if layout.weights != "zero3":  # the compute copy and its float32 gradient sums
        temporaries += int(state.copy_elements * (compute_bytes(cfg) + 4))
    batch_keys = 5  # tokens, targets, segment_ids, positions (int32), loss_mask (float32)
    batch = (cfg.data.global_batch_size * cfg.data.seq_len * 4 * batch_keys
             // shards(cfg, layout.sizes, "batch"))
    peak = state.total + batch + temporaries
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    bubble = pipeline_idle(cfg.model, layout.sizes["pipeline"])  # with chunk padding
    applied, stages = layout.apply(cfg), layout.sizes["pipeline"]
    price = price_compute({k: f * tokens for k, f in flops_by_kernel(
                              cfg, routed_in_fp8=not dequantised_routed(cfg, cluster)).items()},
                          cluster.devices, cluster,
                          imbalance=DEFAULT_LOAD_IMBALANCE if layout.sizes["expert"] > 1 else 1.0,
                          recompute=recompute_factor(applied, stages))
    step = step_time(flops_per_token(cfg) * tokens, cluster.devices, cluster,
                     comm_bytes(cfg, layout, state), bubble, efficiency=price.efficiency,
                     peak=price.peak, pipelined=pipelined_share(applied, stages))
    return Estimate(layout, state.total, temporaries, peak, step.step_s,
                    peak <= cluster.usable_bytes)
