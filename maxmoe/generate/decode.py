"""The decode loop: prefill the prompts in one forward, then one token per step with a KV cache.

Both phases run `extend` (below) on a fixed-size cache of
T = prompt + new tokens slots (model/kv_cache.py): prefill writes slots 0..P-1 and gives the
first token's logits; the decode phase is one jitted lax.while_loop that picks a token,
writes it at slot P + i and computes the next logits, until every row has emitted EOS or N
tokens are out. Prompts are left-padded; positions count from each row's first real token
and the cache mask hides the padding, so a padded row decodes as it would alone.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxmoe.config import Config
from maxmoe.generate.mesh import decode_mesh_sizes, decode_rules, place
from maxmoe.generate.sampling import Sampling, choose
from maxmoe.kernels.grouped_matmul import resolve_kernel
from maxmoe.model.kv_cache import init_cache
from maxmoe.model.transformer import DTYPES, build_model
from maxmoe.sharding import use_mesh


@dataclasses.dataclass
class Generation:
    tokens: np.ndarray  # [B, P + N] int32: the (left-padded) prompts, then the new tokens
    steps: int  # decode steps run (< N when every row stopped at EOS first)
    prefill_s: float  # seconds of the prefill forward (compiled beforehand)
    decode_s: float  # seconds of the decode loop (compiled beforehand)
    compile_s: float  # seconds compiling both (and one warm-up prefill)
    logits: np.ndarray | None = None  # [B, N, V] float32: the logits each new token came from


def left_pad(prompts: list, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts (sequences of ids, any lengths >= 1) -> (ids [B, P] int32 left-padded with
    pad_id, pad [B] int32: the padding slots of each row)."""
    longest = max(len(p) for p in prompts)
    ids = np.full((len(prompts), longest), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            ids[row, longest - len(prompt):] = prompt
    return ids, np.array([longest - len(p) for p in prompts], np.int32)


def decode_config(cfg: Config, dtype: str, experts_split: bool = False) -> Config:
    """cfg computing in `dtype`, its MoE dropless (decoding drops no token). With the experts
    split over devices, a decode step's few tokens go through the grouped matmuls
    (decode_moe.py gathers experts only on an unsplit axis): the configured kernel as resolved
    on this host's devices (tokamax on NVIDIA GPUs), but ragged_dot for blocked, as the blocked
    kernel's 4-block groups fail to trace with fewer than 4 blocks."""
    moe = dataclasses.replace(cfg.moe, dispatch="dropless")
    if experts_split:
        kernel = resolve_kernel(moe.grouped_matmul, dtype)
        moe = dataclasses.replace(moe, grouped_matmul="ragged_dot" if kernel == "blocked"
                                  else kernel)
    return dataclasses.replace(
        cfg, precision=dataclasses.replace(cfg.precision, compute_dtype=dtype), moe=moe)


class Decoder:
    """A model placed on a decode mesh (generate/mesh.py) that generates from token ids."""

    def __init__(self, cfg: Config, params: dict, *, dtype: str = "float32",
                 mesh: dict[str, int] | None = None):
        """cfg: the checkpoint's config; params: its pure param dict (numpy or jax arrays,
        checkpoint_io.load_converted's); mesh: axis sizes overriding the run's (mesh.py)."""
        self.sizes = decode_mesh_sizes(cfg, mesh)
        split = any(self.sizes[a] > 1 for a in cfg.mesh.rules.get("experts", []))
        self.cfg = decode_config(cfg, dtype, experts_split=split)
        model = nnx.eval_shape(lambda: build_model(self.cfg, 0))
        graphdef, _ = nnx.split(model)
        self.model = nnx.merge(graphdef, params)

    def generate(self, ids: np.ndarray, pad: np.ndarray, max_new_tokens: int,
                 sampling: Sampling | None = None, eos_id: int | None = None, pad_id: int = 0,
                 record_logits: bool = False) -> Generation:
        """ids [B, P] left-padded prompts with pad [B] padding slots per row -> Generation.
        A row stops at eos_id (kept) and is filled with pad_id after it."""
        b, p = ids.shape
        sampling = sampling or Sampling()
        rules = decode_rules(self.cfg, self.sizes, b)
        mesh, graphdef, state = place(self.model, self.sizes, rules)
        dtype = DTYPES[self.cfg.precision.compute_dtype]
        prefill = jax.jit(functools.partial(_prefill, graphdef, self.cfg, p + max_new_tokens,
                                            dtype))
        loop = jax.jit(functools.partial(
            _decode, graphdef, sampling, p, max_new_tokens, -1 if eos_id is None else eos_id,
            pad_id, record_logits))
        with use_mesh(mesh, rules):
            ids_j, pad_j = jnp.asarray(ids, jnp.int32), jnp.asarray(pad, jnp.int32)
            key = jax.random.key(sampling.seed)
            t0 = time.perf_counter()
            prefill_c = prefill.lower(state, ids_j, pad_j).compile()
            logits, cache = jax.block_until_ready(prefill_c(state, ids_j, pad_j))  # warm-up
            loop_c = loop.lower(state, cache, logits, pad_j, key).compile()
            t2 = time.perf_counter()
            logits, cache = jax.block_until_ready(prefill_c(state, ids_j, pad_j))
            t3 = time.perf_counter()
            out, steps, recorded = jax.block_until_ready(loop_c(state, cache, logits, pad_j, key))
            t4 = time.perf_counter()
        return Generation(
            tokens=np.concatenate([ids, np.asarray(out)], axis=1).astype(np.int32),
            steps=int(steps), prefill_s=t3 - t2, decode_s=t4 - t3, compile_s=t2 - t0,
            logits=np.asarray(recorded) if record_logits else None)


def _prefill(graphdef, cfg: Config, length: int, dtype, state, ids, pad):
    """The prompts through the model into a fresh cache of `length` slots -> (the last
    position's logits [B, V] float32, cache)."""
    model = nnx.merge(graphdef, state)
    b, p = ids.shape
    cache = init_cache(cfg.model, cfg.attention, b, length, dtype)
    positions = jnp.maximum(jnp.arange(p)[None, :] - pad[:, None], 0)
    x, cache = extend(model, ids, positions, cache, 0, _kv_valid(pad, length))
    return model.logits(x[:, -1:])[:, 0], cache


def _kv_valid(pad: jax.Array, length: int) -> jax.Array:
    """[B, T] bool: slot j of row b holds a real token once written (j >= pad[b])."""
    return jnp.arange(length)[None, :] >= pad[:, None]


def _decode(graphdef, sampling: Sampling, p: int, n: int, eos_id: int, pad_id: int,
            record: bool, state, cache, logits, pad, key):
    """The decode loop from the prefill's logits of P-token prompts -> (new tokens [B, N]
    int32, steps run, the logits each came from [B, N, V] (zeros [B, 0, V] unless `record`))."""
    model = nnx.merge(graphdef, state)
    b, vocab = logits.shape
    kv_valid = _kv_valid(pad, p + n)

    def step(carry):
        i, logits, cache, done, out, seen = carry
        token = jnp.where(done, pad_id, choose(logits, sampling, jax.random.fold_in(key, i)))
        out = out.at[:, i].set(token)
        if record:
            seen = seen.at[:, i].set(logits)
        done = done | (token == eos_id)
        slot = p + i
        x, cache = extend(model, token[:, None], (slot - pad)[:, None], cache, slot, kv_valid)
        return i + 1, model.logits(x)[:, 0], cache, done, out, seen

    def running(carry):
        return (carry[0] < n) & ~jnp.all(carry[3])

    seen = jnp.zeros((b, n if record else 0, vocab), jnp.float32)
    carry = (jnp.int32(0), logits, cache, jnp.zeros((b,), bool),
             jnp.full((b, n), pad_id, jnp.int32), seen)
    i, _, _, _, out, seen = jax.lax.while_loop(running, step, carry)
    return out, i, seen


def extend(model, tokens, positions, caches: list, start, kv_valid):
    """Decoding: tokens [B, S] of cache slots start..start+S-1 at positions [B, S] through
    every layer of `model` (a Transformer) with its KV cache (model/kv_cache.py's init_cache
    layout; kv_valid [B, T]) -> (last hidden state [B, S, D] before the final norm, updated
    caches). No pipeline, no MTP; MoE layers route as in training (dropless unless the config
    says otherwise)."""
    x = model.embed(tokens)
    out = []
    for stack, cache in zip(model.layer_groups, caches, strict=True):
        if isinstance(stack, nnx.List):
            cache = list(cache)
            for i, block in enumerate(stack):
                x, cache[i] = block.extend(x, positions, cache[i], start, kv_valid)
        else:
            graphdef, state = nnx.split(stack)

            def layer(h, state_and_cache, graphdef=graphdef):
                block = nnx.merge(graphdef, state_and_cache[0])
                return block.extend(h, positions, state_and_cache[1], start, kv_valid)

            x, cache = jax.lax.scan(layer, x, (state, cache))
        out.append(cache)
    return x, out
