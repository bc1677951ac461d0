"""One decoder block and how a group of them runs: stacked and scanned, unrolled per layer, or
pipelined, each block under the jax.checkpoint policy model.remat_policy names.

Consecutive layers of the same kind (dense or MoE) form one stack, scanned with lax.scan, so
compile time stays flat in depth; model.scan_layers=false keeps each layer's params apart and
unrolls the layers (faster for a few layers; not with pipelining).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from maxmoe.config import AttentionConfig, ModelConfig, MoEConfig
from maxmoe.model.attention import make_attention
from maxmoe.model.decode_moe import moe_step
from maxmoe.model.layers import MLP, RMSNorm
from maxmoe.model.moe import MoE
from maxmoe.parallel.pipeline import run_pipeline
from maxmoe.parallel.replicas import on_replicas, on_sublayer_replicas, stack_replicas
from maxmoe.parallel.schedule import PipelineSchedule
from maxmoe.sharding import shard

# tensors tagged with jax.ad_checkpoint.checkpoint_name in attention.py, mla.py and moe.py
SAVED_NAMES = ("qkv_proj", "attn_out", "moe_dispatch", "moe_combine")

REMAT_POLICIES = {  # model.remat_policy -> jax.checkpoint policy ("none" = no jax.checkpoint)
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # keep the tagged tensors, recompute the rest (norms, activations, expert internals)
    "save_named": jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES),
    # the same tensors, moved to host memory after the forward pass and back for the backward
    # (XLA:CPU runs it but moves nothing: the placement is lowered only on GPU/TPU)
    "offload_named": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(SAVED_NAMES),
        offload_src="device", offload_dst="pinned_host"),
    # as full, but keep what two_level's hop 1 received across hosts (rows, router weights,
    # expert ids), so the backward's re-run of the block does not send it again: every MoE
    # layer's [H, T, D] rows stay live to the backward. Pipelined, the block's re-run reuses
    # what the stage's re-run received (prerank.hop1_reruns)
    "save_received": jax.checkpoint_policies.save_only_these_names("moe_received"),
}
# the policy whose backward keeps nothing of a block's forward and re-runs it whole from its
# input (the MoE exchanges included): a pipeline stage then runs its slots' re-run one backward
# iteration ahead, beside another microbatch's vjp (parallel/pipeline_loop.Loop). The others keep
# a stage's backward to one forward of its slots, in its iteration: under a policy that saves
# tensors the vjp's own forward must run to save them, so a re-run ahead would be one forward
# more of the slots but the last
RERUNS_WHOLE_BLOCK = ("full",)


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)); x + mlp(norm(x)); mlp dense or MoE."""

    def __init__(self, model: ModelConfig, attention: AttentionConfig, moe: MoEConfig | None,
                 *, dtype, rngs: nnx.Rngs, fp8: str = "none"):
        d, std = model.hidden_size, model.init_std
        self.attn_norm = RMSNorm(d, model.rms_norm_eps)
        self.attn = make_attention(attention, d, std=std, dtype=dtype, rngs=rngs,
                                   norm_eps=model.rms_norm_eps, fp8=fp8)
        self.mlp_norm = RMSNorm(d, model.rms_norm_eps)
        self.mlp = (MoE(moe, d, std=std, dtype=dtype, rngs=rngs, fp8=fp8) if moe is not None
                    else MLP(d, model.dense_mlp_size, std=std, dtype=dtype, rngs=rngs, fp8=fp8))

    def __call__(self, x, segment_ids, positions):
        # named scopes label the ops of each part in profiles (`maxmoe bench --profile`)
        # on_sublayer_replicas: under a compute copy with expert-axis replicas, each expert
        # group of rows on its own replica of these params (parallel/replicas.py)
        with jax.named_scope("attention"):
            a, _ = on_sublayer_replicas(
                lambda b, x, s, p: (b.attn(b.attn_norm(x), s, p), None),
                self, x, segment_ids, positions)
        x = x + a
        h, _ = on_sublayer_replicas(lambda b, x: (b.mlp_norm(x), None), self, x)
        with jax.named_scope("moe" if isinstance(self.mlp, MoE) else "mlp"):
            y, aux = self.mlp(h) if isinstance(self.mlp, MoE) else (on_sublayer_replicas(
                lambda b, h: (b.mlp(h), None), self, h)[0], {})
        x = shard(x + y, ("batch", "seq", "act_embed"))
        aux["activation_rms"] = jnp.sqrt(jnp.mean(jnp.square(x.astype(jnp.float32))))
        return x, aux

    def extend(self, x, positions, cache, start, kv_valid):
        """__call__ for decoding: attention reads and updates its KV cache (Attention.extend,
        LatentAttention.extend), MoE runs only its chosen experts (decode_moe.py) -> (x, cache)."""
        attn, cache = self.attn.extend(self.attn_norm(x), positions, cache, start, kv_valid)
        x = x + attn
        h = self.mlp_norm(x)
        y = moe_step(self.mlp, h) if isinstance(self.mlp, MoE) else self.mlp(h)
        return shard(x + y, ("batch", "seq", "act_embed")), cache


def stacked_blocks(n: int, make, rngs: nnx.Rngs, per_layer: bool = False):
    """n blocks with params stacked on a leading layer axis (scanned later), or with
    per_layer an nnx.List of the n blocks (the same values, each layer's params its own
    arrays)."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def build(r):
        return make(r)
    stack = build(rngs)
    if not per_layer:
        return stack
    graphdef, state = nnx.split(stack)
    return nnx.List([nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
                     for i in range(n)])


def run_layers(graphdef, state, x, segment_ids, positions, *, remat: str, mask=None,
               unroll: bool = False):
    """Applies stacked layers (state leaves [L, ...]) in order with lax.scan, or a Python loop
    over them (`unroll`: a pipeline stage's few slots, whole or some of them: the pipeline's
    backward runs them one at a time, parallel/pipeline_loop.Loop).
    mask [L] bool (the pipeline's padding slots, parallel/pipeline.py): a False layer passes
    x through."""
    def layer(h, layer_state):
        return nnx.merge(graphdef, layer_state)(h, segment_ids, positions)

    def masked(h, layer_state_and_keep):
        layer_state, keep = layer_state_and_keep
        y, aux = layer(h, layer_state)
        return jnp.where(keep, y, h), aux

    body = layer if mask is None else masked

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
    xs = state if mask is None else (state, mask)
    if not unroll:
        return jax.lax.scan(body, x, xs)
    auxs = []
    for k in range(jax.tree.leaves(state)[0].shape[0]):
        x, aux = body(x, jax.tree.map(lambda a, k=k: a[k], xs))
        auxs.append(aux)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *auxs)


def run_blocks(blocks, x, segment_ids, positions, *, remat: str):
    """Applies per-layer blocks (model.scan_layers=false) in order, unrolled; aux [L, ...].

    Each layer's params are their own arrays, so no weight is sliced out of a stack and no
    gradient concatenated back (docs/performance/planning.md, Layer scan vs unrolled)."""
    graphdef, _ = nnx.split(blocks[0])

    def body(h, layer_state):
        return nnx.merge(graphdef, layer_state)(h, segment_ids, positions)

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat])
    auxs = []
    for block in blocks:
        x, aux = body(x, nnx.split(block)[1])
        auxs.append(aux)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *auxs)


def run_stack(stack, x, segment_ids, positions, *, remat: str,
              pipeline: PipelineSchedule | None = None):
    """Applies a layer group: a stacked module scanned (run pipelined on a `pipeline`
    schedule), or an nnx.List of per-layer blocks unrolled. On a compute copy with replicas
    (mesh.weights zero1 / hsdp, sharding.replica_axes) a stack runs once per replica, each
    on its device group's rows (parallel/replicas.py); outside the pipeline those groups span
    the stage axes too (replicas.stack_replicas)."""
    if isinstance(stack, nnx.List):
        return run_blocks(list(stack), x, segment_ids, positions, remat=remat)
    layers = functools.partial(run_layers, remat=remat, unroll=pipeline is not None)
    graphdef, state = nnx.split(stack)

    def run(state, x, segment_ids, positions):
        if pipeline is not None:
            return run_pipeline(nnx.merge(graphdef, state), x, segment_ids, positions,
                                run_layers=layers, schedule=pipeline,
                                ahead=remat in RERUNS_WHOLE_BLOCK)
        return layers(graphdef, state, x, segment_ids, positions)

    replicas = stack_replicas(state, pipeline is not None)
    if replicas:  # zero1 / hsdp: one weight replica per data-parallel group (replicas.py)
        return on_replicas(run, state, x, segment_ids, positions, replicas)
    return run(state, x, segment_ids, positions)



def maybe_remat(module: nnx.Module, policy: str):
    """module's __call__, under jax.checkpoint with REMAT_POLICIES[policy] unless "none"."""
    if policy == "none":
        return module
    graphdef, state = nnx.split(module)

    def apply(state, *args):
        return nnx.merge(graphdef, state)(*args)
    run = jax.checkpoint(apply, policy=REMAT_POLICIES[policy], prevent_cse=False)
    return lambda *args: run(state, *args)

