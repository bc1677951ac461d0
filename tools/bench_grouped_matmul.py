"""Grouped matmul alone vs a dense matmul of the same FLOPs: the ceiling of MoE dispatch.

python tools/bench_grouped_matmul.py [--tokens 32768 --dim 1024 --ffn 512 --experts 64 --topk 6
                                       --dtype bfloat16]
Prints one line per implementation (forward and forward+backward TFLOP/s, ratio to dense) and
a JSON line. Routing is uniform-random top-k, as in a balanced MoE layer. Each figure is the
best of 20 runs: a fixed program's fastest run is its cost with the least of a shared host's
load on it (a 10-run median put the same blocked kernel at 0.70x and 0.92x dense in two
back-to-back runs here).
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxmoe.kernels.grouped_matmul import dropless_local


def timed(f, *args, repeats=20):
    f = jax.jit(f)
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return float(np.min(times))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    dt = jnp.dtype(a.dtype)
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (a.tokens, a.dim), dt)
    wg = (0.02 * jax.random.normal(keys[1], (a.experts, a.dim, a.ffn))).astype(dt)
    wu = (0.02 * jax.random.normal(keys[5], (a.experts, a.dim, a.ffn))).astype(dt)
    wd = (0.02 * jax.random.normal(keys[2], (a.experts, a.ffn, a.dim))).astype(dt)
    weights, idx = jax.lax.top_k(jax.random.uniform(keys[3], (a.tokens, a.experts)), a.topk)
    flops = 3 * 2 * a.tokens * a.topk * a.dim * a.ffn  # gate, up, down
    results = {}

    def report(name, fwd, both):
        """Prints at once: a slow kernel cut off by a timeout loses only its own line."""
        r = results[name] = {"forward_tflops": flops / fwd / 1e12,
                             "train_tflops": 3 * flops / both / 1e12}
        ratio = r["train_tflops"] / results["dense"]["train_tflops"]
        print(f"{name:10s} forward {r['forward_tflops']:.3f} TFLOP/s, forward+backward "
              f"{r['train_tflops']:.3f} TFLOP/s ({ratio:.2f}x dense)", flush=True)

    # dense: the same rows x K through one expert's weights (distinct gate and up weights, or
    # XLA would merge the two identical matmuls and the reference would do 2/3 of the work)
    xd = jnp.tile(x, (a.topk, 1))
    dense = lambda x, wg, wu, wd: (jax.nn.silu(x @ wg[0]) * (x @ wu[0])) @ wd[0]  # noqa: E731
    # backward with a random cotangent: with sum()'s all-ones one XLA turns matmuls into sums.
    # value_and_grad, not grad: the loss value needs the forward's output, so XLA cannot drop
    # the forward matmuls that the gradients do not read (the blocked kernel's backward
    # recomputes gate/up and reads none of its forward, which grad() alone dropped entirely)
    ct = jax.random.normal(keys[4], (a.tokens * a.topk, a.dim), jnp.float32)
    ct_tokens = ct[:a.tokens]
    train = lambda f, ct: jax.value_and_grad(  # noqa: E731
        lambda *t: jnp.sum(f(*t).astype(jnp.float32) * ct), (0, 1, 2, 3))
    report("dense", timed(dense, xd, wg, wu, wd), timed(train(dense, ct), xd, wg, wu, wd))
    for impl in ("ragged_dot", "blocked"):
        f = lambda x, wg, wu, wd, impl=impl: dropless_local(x, idx, weights, wg, wu, wd, 0,  # noqa
                                                            grouped_matmul=impl)
        report(impl, timed(f, x, wg, wu, wd), timed(train(f, ct_tokens), x, wg, wu, wd))
    print(json.dumps({"shape": vars(a), "device": jax.devices()[0].device_kind, **results}))


if __name__ == "__main__":
    main()
