"""Times a peer JAX trainer's model, EasyDeL's MixtralForCausalLM, on maxmoe's CPU reference
shape (issue 8: maxmoe against a JAX peer on the same shapes). EasyDeL pins jax 0.9 and flax
0.12.3, so it gets its own venv (pillow: EasyDeL 0.3.0 imports PIL without requiring it):

    python -m venv /tmp/peer/ez && /tmp/peer/ez/bin/pip install easydel==0.3.0 pillow
    /tmp/peer/ez/bin/python tools/peer_easydel.py --steps 20 [--attn vanilla] [--moe fused_moe]

maxmoe itself also runs in that venv (`PYTHONPATH=. /tmp/peer/ez/bin/python -m maxmoe.cli
bench configs/bench/cpu_mixtral_tiny.yaml`), so both can be timed on the same jax.

Shape = configs/bench/cpu_mixtral_tiny.yaml: vocab 4096, hidden 256, 4 layers, 4 heads (4 kv,
head_dim 64), 8 experts of width 256, top-2, float32 params and compute, one CPU device; batch
8 x 256 synthetic packed rows (4 documents of 64 tokens, uniform random ids in [1, 4096)),
passed to EasyDeL as segment ids (MaskInfo) and per-document positions. The step is written
here with jax/optax around EasyDeL's forward: next-token cross-entropy + 0.01 x EasyDeL's
load-balancing loss + 0.001 x router z-loss (EasyDeL reads a z-loss coefficient but never adds
it to the Mixtral loss), grads of all params, clip_by_global_norm(1.0) + adamw, state donated.
Timing follows `maxmoe bench`: compile once, 2 warm-up steps, then --steps steps each ended by
block_until_ready; median/min/max step time, tokens/s, MFU against the best float32 2048^2
matmul, sampled after every timed step and 10 times at the end (as `maxmoe bench` samples
it). The FLOPs formula and the peak are maxmoe's own (`flops_per_token` of
configs/bench/cpu_mixtral_tiny.yaml, `MatmulPeak`), imported from this checkout.
Prints a summary to stderr and one JSON line on stdout.

Not like for like, in EasyDeL's favour or not: its fused_moe and standard_moe run
lax.ragged_dot_general, which XLA:CPU computes for every expert on every routed row (8x the
active expert FLOPs here); its dense_moe gathers each token's expert weights (~6x slower still).
standard_moe weights the top-2 raw logits by their sum, not a softmax (not Mixtral's routing).
MFU uses maxmoe's model-FLOPs formula (active parameters) on both sides.
"""

import os
import sys

# maxmoe from this checkout: its allocator choice first (maxmoe/malloc.py, standard library
# only), so that both trainers run on the same malloc
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from maxmoe import malloc  # noqa: E402

malloc.reexec(sys.argv)

import argparse
import importlib
import json
import math
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

# EasyDeL 0.3.0 imports every model family at import time, and a few of its configs patch the HF
# PyTorch modeling modules, which raise without torch installed. Empty stand-ins make those
# patches no-ops; nothing Mixtral uses is affected.
try:
    import torch  # noqa: F401
except ImportError:
    for _name in ("glm4v_moe", "llama4", "phimoe", "qwen3_5_moe", "qwen3_next"):
        setattr(importlib.import_module(f"transformers.models.{_name}"), f"modeling_{_name}",
                types.ModuleType(_name))

import easydel
from easydel import MixtralConfig, MixtralForCausalLM
from easydel.infra.loss_utils import auxiliary_load_balancing_loss_func
from ejkernel.types import MaskInfo

# maxmoe's own FLOPs formula and peak measurement (pure JAX, importable from this venv too), so
# both sides of the comparison use one of each
from maxmoe.config_files import load_config  # noqa: E402
from maxmoe.metrics.flops import MatmulPeak, flops_per_token  # noqa: E402

# importing ejkernel points JAX's persistent compilation cache at ~/.cache/ejkernel-cache; maxmoe
# uses none, so turn it off: compile_time_s is a cold compile on both sides
jax.config.update("jax_enable_compilation_cache", False)

BATCH, SEQ, DOCS, VOCAB = 8, 256, 4, 4096
AUX_COEF, Z_COEF = 0.01, 0.001
REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "bench",
                         "cpu_mixtral_tiny.yaml")  # the shape built below, as maxmoe reads it
MODEL_FLOPS_PER_STEP = flops_per_token(load_config([REFERENCE])[0]) * BATCH * SEQ
# --moe: EasyDeL's moe_method values, plus fused_moe with moe_force_xla_gmm=True (standard_moe
# weights experts by top-2 raw logits / their sum, not softmax: not Mixtral's routing)
MOE_OPTIONS = {"fused_moe": ("fused_moe", False), "fused_moe_xla": ("fused_moe", True),
               "standard_moe": ("standard_moe", False), "dense_moe": ("dense_moe", False)}
# the registered attn_mechanism values that train on CPU ("cudnn" is an alias of "sdpa"; "blockwise"
# is in EasyDeL's list but has no implementation; the others are paged/decode kernels)
ATTN_OPTIONS = ("vanilla", "sdpa", "ring", "blocksparse", "flash_attn2")


def build_model(attn: str, moe: str) -> MixtralForCausalLM:
    moe_method, force_xla_gmm = MOE_OPTIONS[moe]
    cfg = MixtralConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=SEQ,
        sliding_window=None, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        num_local_experts=8, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=AUX_COEF, attn_mechanism=attn, moe_method=moe_method,
        moe_force_xla_gmm=force_xla_gmm)
    # read by MixtralSparseMoeBlock as its z-loss coefficient, but EasyDeL 0.3.0 only uses it in
    # standard_moe's optional metrics, never in the Mixtral loss: the z-loss is added in loss_fn
    cfg.router_z_loss_coef = Z_COEF
    return MixtralForCausalLM(cfg, dtype=jnp.float32, param_dtype=jnp.float32,
                              precision=jax.lax.Precision.HIGHEST, rngs=nnx.Rngs(0))


def synthetic_batch(seed: int = 0) -> dict:
    """maxmoe's bench batch: packed rows of 4 equal documents, random tokens, shifted targets."""
    tokens = np.random.default_rng(seed).integers(1, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
    doc = SEQ // DOCS
    segment_ids = np.broadcast_to(np.arange(SEQ) // doc + 1, (BATCH, SEQ)).astype(np.int32)
    positions = np.broadcast_to(np.arange(SEQ) % doc, (BATCH, SEQ)).astype(np.int32)
    batch = dict(tokens=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segment_ids,
                 positions=positions)
    return {k: jnp.asarray(v) for k, v in batch.items()}


def make_step(graphdef, tx, num_experts: int, top_k: int):
    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        out = model(input_ids=batch["tokens"], position_ids=batch["positions"],
                    mask_info=MaskInfo.from_segments(batch["segment_ids"]),
                    output_router_logits=True)
        ce = optax.softmax_cross_entropy_with_integer_labels(out.logits.astype(jnp.float32),
                                                             batch["targets"]).mean()
        # EasyDeL's own balance loss (HF Mixtral form, over all layers' router logits). Its
        # MixtralForCausalLM returns aux_loss = aux * (1 + coef), i.e. weight ~1: not used here.
        balance = auxiliary_load_balancing_loss_func(out.router_logits, num_experts, top_k)
        z = jnp.mean(jnp.stack([jnp.mean(jax.nn.logsumexp(r.astype(jnp.float32), -1) ** 2)
                                for r in out.router_logits]))
        return ce + AUX_COEF * balance + Z_COEF * z, dict(ce=ce, balance=balance, z=z)

    def step(state, rest, batch):
        params, opt_state = state
        (loss, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), dict(loss=loss, **parts)

    return jax.jit(step, donate_argnums=0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--attn", default="vanilla", choices=ATTN_OPTIONS, help="EasyDeL attn_mechanism")
    p.add_argument("--moe", default="fused_moe", choices=list(MOE_OPTIONS),
                   help="EasyDeL moe_method")
    args = p.parse_args()
    assert jax.default_backend() == "cpu" and jax.device_count() == 1, jax.devices()

    model = build_model(args.attn, args.moe)
    cfg = model.config
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(3e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))
    state = (params, tx.init(params))
    batch = synthetic_batch()
    train_step = make_step(graphdef, tx, cfg.num_local_experts, cfg.num_experts_per_tok)

    with cfg.mesh:  # EasyDeL's sharding constraints need a mesh in context (here 1 device)
        t = time.perf_counter()
        compiled = train_step.lower(state, rest, batch).compile()
        compile_s = time.perf_counter() - t
        for i in range(args.warmup + 1):  # + 1: the loss at init comes from the first step
            state, metrics = compiled(state, rest, batch)
            jax.block_until_ready(metrics)
            if i == 0:
                first = {k: float(v) for k, v in metrics.items()}
        times, meter = [], MatmulPeak(jnp.float32)
        for _ in range(args.steps):
            t = time.perf_counter()
            state, metrics = compiled(state, rest, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
            meter.sample()  # between the steps, as `maxmoe bench` does: see MatmulPeak
    peak = meter.sample(10)

    sane = all(map(math.isfinite, first.values())) and abs(first["ce"] - math.log(VOCAB)) < 1.0
    median = float(np.median(times))
    r = dict(step_time_s=median, step_time_min_s=min(times), step_time_max_s=max(times),
             tokens_per_second=BATCH * SEQ / median, mfu=MODEL_FLOPS_PER_STEP / median / peak,
             peak_flops=peak, compile_time_s=compile_s, loss=first["loss"], attn=args.attn,
             moe=args.moe, packed_masking=True, easydel_version=easydel.__version__,
             jax_version=jax.__version__, allocator=malloc.in_use())
    print("\n".join([
        f"EasyDeL {easydel.__version__} MixtralForCausalLM, attn={args.attn} moe={args.moe}, "
        f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {r['allocator']} malloc",
        f"compile        {compile_s:.1f} s",
        f"step time      {1e3 * median:.1f} ms median of {args.steps} (min {1e3 * min(times):.1f}, "
        f"max {1e3 * max(times):.1f})",
        f"tokens/s       {r['tokens_per_second']:.0f}",
        f"MFU            {100 * r['mfu']:.2f}% of {peak:.3e} FLOP/s ({meter.source()}), "
        f"model FLOPs/step {MODEL_FLOPS_PER_STEP:.4e}",
        f"loss at init   {first['loss']:.4f} = ce {first['ce']:.4f} "
        f"(ln {VOCAB} = {math.log(VOCAB):.3f}) "
        f"+ {AUX_COEF} x balance {first['balance']:.4f} + {Z_COEF} x z {first['z']:.4f}"
        f"{'' if sane else '  <-- NOT SANE'}; after {args.warmup + args.steps + 1} steps "
        f"{float(metrics['loss']):.4f}",
        "packing        4 docs/row as segment ids (MaskInfo.from_segments) + per-doc positions",
    ]), file=sys.stderr)
    print(json.dumps(r))
    if not sane:
        sys.exit(1)


if __name__ == "__main__":
    main()
