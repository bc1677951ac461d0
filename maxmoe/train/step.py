"""The train state and the one pure, jitted `train_step(state, batch) -> (state, metrics)`.

The state is a plain pytree {"step", "params", "opt_state"}: params are a pure dict of float32
master weights (Flax NNX graphdef kept outside), so optax, Orbax and jit all see ordinary
arrays with explicit shardings. Models with non-trainable variables (the DeepSeek router bias)
add "buffers": outside the optimizer, updated by the step itself, checkpointed with the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from maxmoe.config import Config
from maxmoe.model.router import RouterBias
from maxmoe.model.transformer import Transformer
from maxmoe.sharding import named, spec, state_shardings, use_mesh
from maxmoe.train.optimizer import learning_rate_schedule, make_optimizer

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}
BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


def build_model(cfg: Config, seed: int = 0) -> Transformer:
    return Transformer(cfg.model, cfg.attention, cfg.moe,
                       dtype=DTYPES[cfg.precision.compute_dtype], rngs=nnx.Rngs(seed))


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


def make_trainer(cfg: Config, mesh: Mesh) -> Trainer:
    rules = cfg.mesh.rules
    abstract_model = nnx.eval_shape(lambda: build_model(cfg, cfg.train.seed))
    graphdef, abstract_vars, abstract_buffers = nnx.split(abstract_model, nnx.Param, RouterBias)
    param_shardings = nnx.to_pure_dict(state_shardings(abstract_vars, mesh, rules))
    has_buffers = bool(jax.tree.leaves(abstract_buffers))
    optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
    schedule = learning_rate_schedule(cfg.optimizer, cfg.train.steps)
    replicated = NamedSharding(mesh, P())

    def init_state():
        _, params, buffers = nnx.split(build_model(cfg, cfg.train.seed), nnx.Param, RouterBias)
        params = nnx.to_pure_dict(params)
        state = {"step": jnp.zeros((), jnp.int32), "params": params,
                 "opt_state": optimizer.init(params)}
        return dict(state, buffers=nnx.to_pure_dict(buffers)) if has_buffers else state

    abstract = jax.eval_shape(init_state)
    # optimizer moments mirror their params; everything else (counts, step) is replicated
    opt_shardings = optax.tree_map_params(
        optimizer, lambda _, s: s, abstract["opt_state"], param_shardings,
        transform_non_params=lambda _: replicated)
    shardings = {"step": replicated, "params": param_shardings, "opt_state": opt_shardings}
    if has_buffers:
        shardings["buffers"] = nnx.to_pure_dict(state_shardings(abstract_buffers, mesh, rules))
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    with use_mesh(mesh, rules):
        batch_sharding = named(("batch", "seq"))
        micro_spec = spec((None, "batch", "seq"))
    train_step = make_train_step(cfg, graphdef, optimizer, schedule, micro_spec)

    def run_in_mesh(fn):
        def wrapped(*args):
            with use_mesh(mesh, rules):
                return fn(*args)
        return wrapped

    init = run_in_mesh(jax.jit(init_state, out_shardings=shardings))
    jitted_step = jax.jit(train_step, in_shardings=(shardings, batch_sharding),
                          out_shardings=(shardings, replicated), donate_argnums=0)
    step = run_in_mesh(jitted_step)
    return Trainer(graphdef, optimizer, shardings, batch_sharding, init, step, abstract, mesh,
                   rules, jitted_step)


def make_train_step(cfg: Config, graphdef, optimizer, schedule, micro_spec: P):
    """Builds the pure step; every variant (accumulation, precision) is chosen here."""
    accum = cfg.train.grad_accum_steps
    bias_speed = cfg.moe.bias_update_speed

    def loss_fn(params, batch, buffers):
        return nnx.merge(graphdef, params, *buffers).loss(batch)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def gradients(params, batch, buffers):
        if accum == 1:
            (_, metrics), grads = grad_fn(params, batch, buffers)
            return grads, metrics

        def split(x):  # [B, ...] -> [A, B/A, ...]; microbatch j takes rows j, j+A, ...
            x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
            return jax.lax.with_sharding_constraint(x, P(*micro_spec[: x.ndim]))

        def body(acc, micro):
            (_, metrics), grads = grad_fn(params, micro, buffers)
            return jax.tree.map(jnp.add, acc, (grads, metrics)), None

        micro = jax.tree.map(split, batch)
        (_, metric_shapes), grad_shapes = jax.eval_shape(
            grad_fn, params, jax.tree.map(lambda x: x[0], micro), buffers)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (grad_shapes, metric_shapes))
        (grads, metrics), _ = jax.lax.scan(body, zeros, micro)
        return jax.tree.map(lambda x: x / accum, (grads, metrics))

    def train_step(state, batch):
        params = state["params"]
        buffers = (state["buffers"],) if "buffers" in state else ()
        grads, metrics = gradients(params, batch, buffers)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        metrics = dict(metrics, grad_norm=optax.global_norm(grads),
                       learning_rate=schedule(state["step"]),
                       param_norm=optax.global_norm(new_params))
        new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}
        if buffers:
            new_state["buffers"] = buffers[0]
            if bias_speed:  # aux-loss-free balancing: once per optimizer step, from this load
                model = nnx.merge(graphdef, new_params, buffers[0])
                model.update_router_bias(metrics["expert_load"], bias_speed)
                new_state["buffers"] = nnx.to_pure_dict(nnx.state(model, RouterBias))
        return new_state, metrics

    return train_step
