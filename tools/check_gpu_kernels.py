"""The GPU kernels maxmoe's `auto` picks on NVIDIA GPUs (kernels/tokamax_ops.py: tokamax's
Mosaic GPU grouped GEMM and flash attention), run on the device, against float32 references
computed on the host CPU from the same bfloat16 inputs. First stage of tools/gpu_check.sh.

Per kernel and per output (forward, input gradient, weight gradient / dq dk dv), the largest
error relative to the reference's largest magnitude, max|got - ref| / max|ref|:
- grouped GEMM, raw: tokamax's ragged_dot_general with float32 output (what the kernel
  accumulates), each of the three contractions the training step runs. Pass: within the CPU
  ragged-vs-blocked equivalence tolerance (tests/kernels/test_grouped_matmul.py: rtol 1e-4,
  atol 1e-5), as max err <= 1e-4.
- grouped GEMM and attention, as training runs them (bfloat16 out, tokamax_ops' custom VJPs):
  each output rounds to bfloat16, so the reference for the error is the CPU kernel's own
  (lax.ragged_dot / kernels.attention.attention_core in bfloat16, on the host). Pass: the GPU's
  error is at most 1.5x the CPU kernel's, plus 1e-3 of a bfloat16 ulp.
Rows past the groups must be exactly 0 (the wrapper zeroes what the kernel leaves unwritten).

    python tools/check_gpu_kernels.py [--rows 8192 --dim 1024 --ffn 512 --experts 16]
        [--seq 2048 --heads 8] [--kernel tokamax|lax]
--kernel lax runs jax.lax's ragged dot and the einsum attention in place of tokamax (the CPU
dry run of gpu_check.sh: checks this script, not a GPU). Prints one JSON line per check and
a last line {"passed": bool}; exits 1 when a check fails.
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from maxmoe.kernels import tokamax_ops
from maxmoe.kernels.attention import attention_core

RAW_TOL = 1e-4
DIMS = {"forward": tokamax_ops._FORWARD, "input_grad": tokamax_ops._INPUT_GRAD,
        "weight_grad": tokamax_ops._WEIGHT_GRAD}


def err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def on(device, *arrays):
    return [jax.device_put(a, device) for a in arrays]


def ragged_operands(args, rng):
    """(x [M, K], w [G, K, N], g [M, N]) bf16 and sizes [G] summing to 7/8 of M."""
    m, k, n, e = args.rows, args.dim, args.ffn, args.experts
    cuts = np.sort(rng.integers(0, m * 7 // 8, e - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [m * 7 // 8]])).astype(np.int32)
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = (rng.normal(size=(e, k, n)) / np.sqrt(k)).astype(np.float32)
    g = rng.normal(size=(m, n)).astype(np.float32)
    return [jnp.asarray(a, jnp.bfloat16) for a in (x, w, g)], jnp.asarray(sizes)


def check_ragged(args, gpu, cpu, rng) -> list[dict]:
    (x, w, g), sizes = ragged_operands(args, rng)
    operands = {"forward": (x, w), "input_grad": (g, w), "weight_grad": (x, g)}
    rows = []
    for name, (lhs, rhs) in operands.items():
        ref = jax.lax.ragged_dot_general(*on(cpu, lhs.astype(jnp.float32),
                                             rhs.astype(jnp.float32), sizes), DIMS[name])
        if args.kernel == "tokamax":
            with jax.default_device(gpu):
                got = tokamax_ops._tokamax().ragged_dot_general(
                    *on(gpu, lhs, rhs, sizes), DIMS[name], implementation="mosaic",
                    preferred_element_type=jnp.float32)
        else:
            got = jax.lax.ragged_dot_general(*on(gpu, lhs, rhs, sizes), DIMS[name],
                                             preferred_element_type=jnp.float32)
        if name != "weight_grad":  # the kernel leaves rows past the groups unwritten
            got, ref = (np.asarray(a)[: int(sizes.sum())] for a in (got, ref))
        e = err(got, ref)
        rows.append({"check": f"ragged_dot raw {name} (float32 out)", "max_err": e,
                     "tol": RAW_TOL, "passed": e <= RAW_TOL})
    return rows + check_ragged_trained(args, gpu, cpu, x, w, g, sizes)


def check_ragged_trained(args, gpu, cpu, x, w, g, sizes) -> list[dict]:
    """tokamax_ops.ragged_dot (bf16 out, custom VJP) on the GPU and lax.ragged_dot in bf16 on
    the CPU, both against lax.ragged_dot in float32 on the CPU."""
    def run(fn, device, dtype):
        xs, ws, gs, ss = on(device, x.astype(dtype), w.astype(dtype), g.astype(dtype), sizes)
        out, pull = jax.vjp(lambda a, b: fn(a, b, ss), xs, ws)
        return (out, *pull(gs))
    ref = run(jax.lax.ragged_dot, cpu, jnp.float32)
    base = run(jax.lax.ragged_dot, cpu, jnp.bfloat16)
    kernel = tokamax_ops.ragged_dot if args.kernel == "tokamax" else jax.lax.ragged_dot
    with jax.default_device(gpu):
        got = run(kernel, gpu, jnp.bfloat16)
    rows = []
    for name, r, b, o in zip(("forward", "input_grad", "weight_grad"), ref, base, got,
                             strict=True):
        if name != "weight_grad":
            assert not np.any(np.asarray(o, np.float32)[int(sizes.sum()):]), \
                f"ragged_dot {name}: rows past the groups are not 0"
        rows.append(versus_cpu(f"ragged_dot trained {name} (bf16 out)", err(o, r), err(b, r)))
    return rows


def versus_cpu(check: str, gpu_err: float, cpu_err: float) -> dict:
    tol = 1.5 * cpu_err + 1e-3 * 2.0 ** -8
    return {"check": check, "max_err": gpu_err, "cpu_kernel_err": cpu_err, "tol": tol,
            "passed": gpu_err <= tol}


def check_attention(args, gpu, cpu, rng) -> list[dict]:
    """Causal attention inside documents at MLA's head dims (q/k 192, v 128): the GPU kernel
    (bf16) and attention_core (the CPU kernel) in bf16, against attention_core in float32."""
    b, s, h = 2, args.seq, args.heads
    q, k = (rng.normal(size=(b, s, h, 192)).astype(np.float32) for _ in range(2))
    v, dy = (rng.normal(size=(b, s, h, 128)).astype(np.float32) for _ in range(2))
    q, k, v, dy = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v, dy))
    segment_ids = jnp.asarray(np.repeat([[0, 1, 2, 3]], b, 0).repeat(s // 4, 1), jnp.int32)
    scale = 192 ** -0.5

    def heads_first(a):  # [B, S, H, D] -> [B, H, 1, S, D]: kv head h, G = 1
        return a.transpose(0, 2, 1, 3)[:, :, None]

    def core(q, k, v, seg):  # [B, S, H, D] in and out, as tokamax_ops.flash_attention
        out = attention_core(heads_first(q * scale), heads_first(k)[:, :, 0],
                             heads_first(v)[:, :, 0], seg)
        return out[:, :, 0].transpose(0, 2, 1, 3)

    def flash(q, k, v, seg):
        return tokamax_ops.flash_attention(q, k, v, tokamax_ops.document_mask(seg), scale)

    def run(fn, device, dtype):
        qs, ks, vs, gs, ss = on(device, q.astype(dtype), k.astype(dtype), v.astype(dtype),
                                dy.astype(dtype), segment_ids)
        out, pull = jax.vjp(lambda a, c, d: fn(a, c, d, ss), qs, ks, vs)
        return (out, *pull(gs))
    ref, base = run(core, cpu, jnp.float32), run(core, cpu, jnp.bfloat16)
    with jax.default_device(gpu):
        got = run(flash if args.kernel == "tokamax" else core, gpu, jnp.bfloat16)
    return [versus_cpu(f"attention {name} (bf16, qk 192 / v 128, 4 documents)", err(o, r),
                       err(c, r))
            for name, r, c, o in zip(("out", "dq", "dk", "dv"), ref, base, got, strict=True)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kernel", choices=["tokamax", "lax"], default="tokamax")
    args = p.parse_args()
    cpu = jax.devices("cpu")[0]
    gpu = jax.devices()[0]
    print(json.dumps({"device": gpu.device_kind, "jax": jax.__version__,
                      "kernel": args.kernel}), flush=True)
    rng = np.random.default_rng(0)
    passed = True
    for check in (check_ragged, check_attention):
        try:
            rows = check(args, gpu, cpu, rng)
        except Exception as e:  # noqa: BLE001 - one kernel's failure must not hide the other's
            rows = [{"check": check.__name__, "error": f"{type(e).__name__}: {e}"[:2000],
                     "passed": False}]
        for row in rows:
            print(json.dumps(row), flush=True)
            passed &= row["passed"]
    print(json.dumps({"passed": passed}))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
