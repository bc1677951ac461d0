"""The train state and the one pure, jitted `train_step(state, batch) -> (state, metrics)`.

The state is a plain pytree {"step", "params", "opt_state", "guard"}: params are a pure dict of
float32 master weights (Flax NNX graphdef kept outside), so optax, Orbax and jit all see
ordinary arrays with explicit shardings. Models with non-trainable variables (the DeepSeek
router bias) add "buffers": outside the optimizer, updated by the step itself, checkpointed
with the rest. float16 (dynamic loss scaling) adds "loss_scale" (precision.py); "guard" holds
the skip counters and spike statistics (guards.py).

A step whose update is not applied (non-finite gradients, a spike, the gradient-norm ceiling)
leaves params, optimizer state (so its count and the LR/clip schedules) and buffers bit for
bit as they were; only "step", the guard counters and the loss scale move.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec as P

from maxmoe.config import Config
from maxmoe.metrics.diagnostics import grad_norms_by_group, update_ratios
from maxmoe.metrics.router_health import init_window, update_window
from maxmoe.model.router import RouterBias
from maxmoe.model.spec import layer_groups, moe_layer_indices
from maxmoe.model.transformer import build_model
from maxmoe.parallel.dispatch import resolve_transport
from maxmoe.sharding import named, spec, state_shardings, use_mesh
from maxmoe.train.gradients import ComputeCopy, compute_copy_of, make_gradients
from maxmoe.train.guards import StepGuard, select
from maxmoe.train.optimizer import learning_rate_schedule, make_optimizer
from maxmoe.train.precision import make_loss_scaler

# XLA:GPU's options for the train step, the one place they are set (the real run and the
# planner's deviceless compile alike). The latency-hiding scheduler is off by default in jaxlib
# 0.12's XLA:GPU: without it every collective with nothing scheduled between its start and done
# is made synchronous, the ragged all-to-alls and the weight gathers included, so no
# communication runs under compute (docs: parallelism, "Communication under compute")
XLA_GPU_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True}
# moe.collectives_in_flight's XLA:GPU option (the scheduler's limit on collectives in flight)
IN_FLIGHT_OPTION = "xla_gpu_experimental_parallel_collective_overlap_limit"

BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


@dataclasses.dataclass(frozen=True)
class Trainer:
    """Everything built once per run: graphdef, optimizer, shardings and the jitted step."""
    graphdef: Any
    optimizer: optax.GradientTransformation
    state_shardings: Any
    batch_sharding: NamedSharding
    init: Callable[[], Any]  # () -> sharded initial state
    step: Callable[[Any, dict], tuple[Any, dict]]  # jitted train_step, state donated
    abstract_state: Any  # ShapeDtypeStructs with shardings (for checkpoint restore)
    mesh: Mesh
    rules: dict  # logical-axis rules the step was traced with
    jitted_step: Any  # the jax.jit object behind `step` (lower/compile for analysis)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """The train state's structure and placement on one mesh, before anything is jitted."""
    graphdef: Any
    optimizer: optax.GradientTransformation
    init_state: Callable[[], Any]  # () -> the initial state (unsharded; jit places it)
    shardings: Any  # NamedSharding per state leaf
    device_opt_shardings: Any  # optimizer.offload_state: the moments' on-device shardings
    abstract: Any  # ShapeDtypeStructs carrying `shardings`
    compute: ComputeCopy | None  # mesh.weights zero1 / hsdp; None under zero3


def state_layout(cfg: Config, mesh: Mesh | AbstractMesh) -> StateLayout:
    """The train state {step, params, opt_state, guard, [loss_scale], [buffers],
    [router_health]} of `cfg` and its shardings on `mesh`: params and buffers as
    `sharding.state_shardings` places them, optimizer moments as their params, counters
    (router_health's [L_moe, E] window too) replicated. Traces shapes only, so an
    AbstractMesh of any cluster size works (the structural sharding test, the planner)."""
    rules = cfg.mesh.rules
    abstract_model = nnx.eval_shape(lambda: build_model(cfg, cfg.train.seed))
    graphdef, abstract_vars, abstract_buffers = nnx.split(abstract_model, nnx.Param, RouterBias)
    param_shardings = nnx.to_pure_dict(state_shardings(abstract_vars, mesh, rules))
    has_buffers = bool(jax.tree.leaves(abstract_buffers))
    optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
    scaler = make_loss_scaler(cfg.precision)
    step_guard = StepGuard.from_config(cfg.guard)
    replicated = NamedSharding(mesh, P())
    moe_rows = len(moe_layer_indices(cfg.model))

    def init_state():
        _, params, buffers = nnx.split(build_model(cfg, cfg.train.seed), nnx.Param, RouterBias)
        params = nnx.to_pure_dict(params)
        state = {"step": jnp.zeros((), jnp.int32), "params": params,
                 "opt_state": optimizer.init(params), "guard": step_guard.init()}
        if scaler is not None:
            state["loss_scale"] = scaler.init()
        if moe_rows:  # the expert load of the logging window (metrics/router_health.py)
            state["router_health"] = init_window(moe_rows, cfg.moe.num_experts)
        return dict(state, buffers=nnx.to_pure_dict(buffers)) if has_buffers else state

    abstract = jax.eval_shape(init_state)
    # optimizer moments mirror their params; everything else (counts, step) is replicated
    opt_shardings = optax.tree_map_params(
        optimizer, lambda _, s: s, abstract["opt_state"], param_shardings,
        transform_non_params=lambda _: replicated)
    device_opt_shardings = None
    if cfg.optimizer.offload_state:  # ZeRO-offload analogue: moments live in host memory
        device_opt_shardings = opt_shardings
        opt_shardings = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), opt_shardings)
    shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings,
                 "guard": jax.tree.map(lambda _: replicated, abstract["guard"])}
    for key in ("loss_scale", "router_health"):
        if key in abstract:
            shardings[key] = jax.tree.map(lambda _: replicated, abstract[key])
    if has_buffers:
        shardings["buffers"] = nnx.to_pure_dict(state_shardings(abstract_buffers, mesh, rules))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    return StateLayout(graphdef, optimizer, init_state, shardings, device_opt_shardings,
                       abstract, compute_copy_of(cfg, mesh, abstract_vars, param_shardings))


def gpu_options(cfg: Config) -> dict:
    """The step's XLA:GPU compile options: XLA_GPU_OPTIONS, with moe.collectives_in_flight where
    it is not XLA's default 1 (nothing when XLA_GPU_OPTIONS is emptied: no scheduler to limit)."""
    n = cfg.moe.collectives_in_flight
    return XLA_GPU_OPTIONS if n == 1 or not XLA_GPU_OPTIONS else {**XLA_GPU_OPTIONS,
                                                                IN_FLIGHT_OPTION: n}


def make_trainer(cfg: Config, mesh: Mesh) -> Trainer:
    cfg = resolve_transport(cfg, dict(mesh.shape))  # moe.transport=auto: the layout's choice
    rules = cfg.mesh.rules
    layout = state_layout(cfg, mesh)
    graphdef, optimizer, shardings = layout.graphdef, layout.optimizer, layout.shardings
    schedule = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
    replicated = NamedSharding(mesh, P())
    with use_mesh(mesh, rules):
        batch_sharding = named(("batch", "seq"))
        micro_spec = spec((None, "batch", "seq"))
    train_step = make_train_step(cfg, graphdef, optimizer, schedule, micro_spec,
                                 layout.device_opt_shardings, layout.compute)

    def run_in_mesh(fn):
        def wrapped(*args):
            with use_mesh(mesh, rules):
                return fn(*args)
        return wrapped

    init = run_in_mesh(jax.jit(layout.init_state, out_shardings=shardings))
    gpu = mesh.devices.flat[0].platform == "gpu"
    jitted_step = jax.jit(train_step, in_shardings=(shardings, batch_sharding),
                          out_shardings=(shardings, replicated), donate_argnums=0,
                          compiler_options=gpu_options(cfg) if gpu else None)
    step = run_in_mesh(jitted_step)
    return Trainer(graphdef, optimizer, shardings, batch_sharding, init, step, layout.abstract,
                   mesh, rules, jitted_step)


def per_layer(metrics: dict, cfg: Config) -> jax.Array | None:
    """[L (+ MTP)] residual RMS in layer order, from the model's per-kind arrays."""
    dense, moe = metrics.get("dense_activation_rms"), metrics.get("activation_rms")
    parts, used = [], {"dense": 0, "moe": 0}
    for is_moe, _, n in layer_groups(cfg.model):
        kind, values = ("moe", moe) if is_moe else ("dense", dense)
        if values is None:
            return None
        parts.append(values[used[kind]:used[kind] + n])
        used[kind] += n
    if moe is not None and moe.shape[0] > used["moe"]:
        parts.append(moe[used["moe"]:])  # MTP blocks come last
    return jnp.concatenate(parts)


# per-step diagnostics computed only on the steps whose metrics the loop writes (NaN on others)
DIAGNOSTICS = ("update_ratio_by_layer", "update_ratio_max", "param_norm", "grad_norm_by_group")


def writes_metrics(done, cfg: Config):
    """Whether the loop writes the metrics of step `done` (steps done so far, 1-based): every
    logging.every_steps, the last step and every eval step. Python ints or traced arrays.

    The step computes DIAGNOSTICS only then, as Megatron computes its params norm only on
    logging iterations: they cost three passes over the parameters."""
    hit = (done % cfg.logging.every_steps == 0) | (done == cfg.train.steps)
    if cfg.train.eval_every_steps:
        hit = hit | (done % cfg.train.eval_every_steps == 0)
    return hit


def when_logged(diagnose, f, *args):
    """f(*args) on the steps whose metrics the loop writes (`diagnose`), NaN of its shapes on
    the others (f may return a pytree): one branch runs (lax.cond)."""
    out = jax.eval_shape(f, *args)
    return jax.lax.cond(diagnose, f, lambda *_: jax.tree.map(
        lambda s: jnp.full(s.shape, jnp.nan, s.dtype), out), *args)


def guarded_update(optimizer, apply, diagnose, grads, grad_norm, params, opt_state):
    """(new params, new optimizer state, [L] update ratios): the optimizer's update where
    `apply`, else params and optimizer state bit for bit as they were and zero ratios."""
    # one branch runs, so an applied step pays nothing for the guard (a select over every
    # leaf would read and write all of them)
    def update(_):
        with jax.named_scope("optimizer"):
            updates, new_opt_state = optimizer.update(grads, opt_state, params,
                                                      grad_norm=grad_norm)
            new_params = optax.apply_updates(params, updates)
            return new_params, new_opt_state, when_logged(diagnose, update_ratios, new_params,
                                                          params)

    def keep(_):
        ratios = jax.eval_shape(update, None)[2]
        return params, opt_state, jnp.zeros(ratios.shape, ratios.dtype)

    return jax.lax.cond(apply, update, keep, None)


def updated_buffers(graphdef, new_params, buffers, metrics: dict, bias_speed: float, apply):
    """The router-bias buffers after the step: moved by aux-loss-free balancing (once per
    optimizer step, from this step's load) where `apply` and bias_speed, else unchanged."""
    if not bias_speed:
        return buffers
    model = nnx.merge(graphdef, new_params, buffers)
    model.update_router_bias(metrics["expert_load"], bias_speed)
    return select(apply, nnx.to_pure_dict(nnx.state(model, RouterBias)), buffers)


# per-layer metrics of the model's loss that logging.per_layer=false leaves out of the step
PER_LAYER_ONLY = ("router_entropy", "dropped_fraction_by_layer")


def per_layer_metrics(cfg: Config, graphdef, metrics: dict, grads, new_params, new_buffers,
                      diagnose) -> dict:
    """`metrics` with the per-layer arrays of docs/observability.md that the step adds
    (grad_norm_by_group on logged steps, router_bias after the step's update) or, with
    logging.per_layer=false, without the model's per-layer arrays (PER_LAYER_ONLY)."""
    if not cfg.logging.per_layer:
        return {k: v for k, v in metrics.items() if k not in PER_LAYER_ONLY}
    out = dict(metrics, grad_norm_by_group=when_logged(diagnose, grad_norms_by_group, grads))
    if new_buffers is not None:
        bias = nnx.merge(graphdef, new_params, new_buffers).router_bias()
        if bias is not None:
            out["router_bias"] = bias
    return out


def make_train_step(cfg: Config, graphdef, optimizer, schedule, micro_spec: P,
                    device_opt_shardings=None, copy: ComputeCopy | None = None):
    """Builds the pure step; every variant (accumulation, precision, offload, mesh.weights) is
    chosen here.

    device_opt_shardings: the optimizer state's device shardings when it is kept in host
    memory (the step moves it in, updates it on the device, and out_shardings move it back).
    copy: the compute copy of mesh.weights zero1 / hsdp (make_gradients).
    """
    gradients = make_gradients(cfg, graphdef, micro_spec, copy)
    scaler = make_loss_scaler(cfg.precision)
    step_guard = StepGuard.from_config(cfg.guard)

    def train_step(state, batch):
        params = state["params"]
        buffers = (state["buffers"],) if "buffers" in state else ()
        scale_state = state.get("loss_scale")
        grads, metrics = gradients(params, batch, buffers, scale_state)
        if scaler is not None:
            grads = scaler.unscale(grads, scale_state)
        grad_norm = optax.tree.norm(grads)
        # a NaN or inf in any gradient makes the norm non-finite: one pass over the gradients,
        # not two. A finite gradient above ~1e19 overflows the squared sum and counts as
        # non-finite too, which the guard would skip anyway.
        finite = jnp.isfinite(grad_norm)
        opt_state = state["opt_state"]
        if device_opt_shardings is not None:
            opt_state = jax.device_put(opt_state, device_opt_shardings)
        apply, guard_state, guard_metrics = step_guard.check(
            state["guard"], metrics["loss"], grad_norm, finite)
        diagnose = writes_metrics(state["step"] + 1, cfg)
        new_params, new_opt_state, layer_ratio = guarded_update(
            optimizer, apply, diagnose, grads, grad_norm, params, opt_state)
        # the optimizer's own count drives the LR and clip schedules: it is the applied steps
        applied_before = state["step"] - state["guard"]["skipped_steps"]
        metrics = dict(metrics, **{k: v.astype(jnp.int32) if v.dtype == jnp.bool_ else v
                                   for k, v in guard_metrics.items()},
                       grad_norm=grad_norm, learning_rate=schedule(applied_before),
                       update_ratio_by_layer=layer_ratio, update_ratio_max=jnp.max(layer_ratio))
        rms = per_layer(metrics, cfg)
        if rms is not None:
            metrics.update(activation_rms_by_layer=rms, activation_rms_max=jnp.max(rms))
        metrics["param_norm"] = when_logged(diagnose, optax.tree.norm, new_params)
        new_state = {"step": state["step"] + 1, "params": new_params,
                     "opt_state": new_opt_state, "guard": guard_state}
        if scaler is not None:
            new_state["loss_scale"], at_min = scaler.update(scale_state, finite)
            metrics.update(loss_scale=new_state["loss_scale"]["scale"],
                           loss_scale_at_min=at_min.astype(jnp.int32))
        if buffers:
            new_state["buffers"] = updated_buffers(graphdef, new_params, buffers[0], metrics,
                                                   cfg.moe.bias_update_speed, apply)
        if "router_health" in state:  # the window closes where the loop logs
            new_state["router_health"], metrics["expert_zero_windows"] = update_window(
                state["router_health"], metrics["expert_load"], diagnose)
        metrics = per_layer_metrics(cfg, graphdef, metrics, grads, new_params,
                                    new_state.get("buffers"), diagnose)
        return new_state, metrics

    return train_step
