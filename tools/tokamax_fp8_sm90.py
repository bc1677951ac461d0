"""What tokamax's Mosaic GPU ragged_dot takes for the FP8 routed experts on SM90, and at what
cost, from the deviceless XLA:GPU compile for one H100 (docs/gpu_aot.md, "FP8 routed experts").

JAX_PLATFORMS=cpu PYTHONPATH=. .venv312/bin/python tools/tokamax_fp8_sm90.py [NAME_PART ...]

Needs jax[cuda12] and tokamax (`pip install -e ".[cuda]"`, Python >= 3.12). One shape: x [T, D]
bf16 rows over G experts' w [G, D, F] (the issue's 8192 x 2048 -> 1024, 16 experts). Each
attempt prints one JSON line: tokamax's refusal (its first line), or the compiled program's
temporaries and peak (MiB), custom calls, FP8 dots (tools/fp8_hlo.fp8_counts), reduce-precision
ops and [G, T, ...] dense-expansion buffers. Attempts: single GEMMs with raw E4M3 arrays
(FP8 x FP8), with E4M3 weights as a qwix QArray (weight-only; activations bf16 or f16), then
forward + both gradients of maxmoe's paths. No timing: there is no GPU here.
"""

import json
import re
import sys

import jax
import jax.numpy as jnp

from maxmoe.bench import memory_analysis
from maxmoe.kernels import tokamax_ops
from maxmoe.kernels.fp8_ragged import dequantised_ragged_dot, fp8_ragged_dot
from maxmoe.plan.gpu_aot import gpu_devices
from tools.fp8_hlo import fp8_counts

T, D, F, G = 8192, 2048, 1024, 16
F8, BF16, F16 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float16
CUSTOM = re.compile(r'custom_call_target="([^"]+)"')


def gemm(dims, out, quantized):
    """One tokamax ragged_dot_general (implementation "mosaic") with these dimension numbers;
    quantized: rhs is (E4M3 values, scales) for a qwix QArray (tokamax's quantised weight)."""
    def f(lhs, *rhs_and_sizes):
        *rhs, sizes = rhs_and_sizes
        if quantized:
            import qwix  # late: tokamax's dependency, present only with the cuda extra
            rhs = [qwix.QArray(rhs[0], rhs[1], None, F8)]
        return tokamax_ops._tokamax().ragged_dot_general(
            lhs, rhs[0], sizes, dims, implementation="mosaic", preferred_element_type=out)
    return f


def gradients(product):
    """x, w, g, sizes -> (product, dx, dw): forward and both gradients of a maxmoe path."""
    def f(x, w, g, sizes):
        y, pull = jax.vjp(lambda a, b: product(a, b, sizes), x, w)
        return y, *pull(g)
    return f


def attempts():
    """(name, function, operand shapes and dtypes) of each attempt, sizes [G] int32 last."""
    fwd, into, wgrad = tokamax_ops._FORWARD, tokamax_ops._INPUT_GRAD, tokamax_ops._WEIGHT_GRAD
    x, w, g = ((T, D), (G, D, F), (T, F))
    w_t = (G, F, D)  # the input gradient's weight, transposed so scales run along its K
    return [
        ("FP8 x FP8 forward", gemm(fwd, BF16, False), [(x, F8), (w, F8)]),
        ("FP8 x FP8 input grad", gemm(into, BF16, False), [(g, F8), (w, F8)]),
        ("FP8 x FP8 weight grad", gemm(wgrad, BF16, False), [(x, F8), (g, F8)]),
        ("weight-only bf16 forward", gemm(fwd, BF16, True),
         [(x, BF16), (w, F8), ((G, D // 128, F), BF16)]),
        ("weight-only bf16 input grad", gemm(fwd, BF16, True),
         [(g, BF16), (w_t, F8), ((G, F // 128, D), BF16)]),
        ("weight-only f16 forward", gemm(fwd, F16, True),
         [(x, F16), (w, F8), ((G, D // 128, F), F16)]),
        ("weight-only f16 input grad", gemm(fwd, F16, True),
         [(g, F16), (w_t, F8), ((G, F // 128, D), F16)]),
        ("bf16 tokamax_ops.ragged_dot, fwd + grads", gradients(tokamax_ops.ragged_dot),
         [(x, BF16), (w, BF16), (g, BF16)]),
        *[(f"dequantised_ragged_dot {mode}, fwd + grads",
           gradients(lambda a, b, s, mode=mode: dequantised_ragged_dot(a, b, s, mode)),
           [(x, BF16), (w, BF16), (g, BF16)]) for mode in ("blockwise", "tensorwise")],
        ("fp8_ragged_dot blockwise (lax.ragged_dot), fwd + grads",
         gradients(lambda a, b, s: fp8_ragged_dot(a, b, s, "blockwise")),
         [(x, BF16), (w, BF16), (g, BF16)]),
    ]


def measure(name, f, operands, device) -> dict:
    """Lowers f (inside kernel_device) and compiles it for `device`: its figures, or the
    first line of tokamax's / Mosaic's refusal."""
    place = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(s, d, sharding=place) for s, d in [*operands, ((G,), jnp.int32)]]
    try:
        with tokamax_ops.kernel_device([device]):
            lowered = jax.jit(f).lower(*args)
        compiled = lowered.compile()
    except (NotImplementedError, ValueError) as e:
        return {"name": name, "refused": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    hlo, mib = compiled.as_text(), memory_analysis(compiled)
    calls = {}
    for target in CUSTOM.findall(hlo):
        calls[target] = calls.get(target, 0) + 1
    return {"name": name, "temps_mib": round(mib["temp_bytes"] / 2**20, 1),
            "peak_mib": round(mib["peak_bytes"] / 2**20, 1), "custom_calls": calls,
            "fp8": {k: v for k, v in fp8_counts(hlo).items() if v},
            "reduce_precision": hlo.count(" reduce-precision("),
            "dense_buffers": sorted(set(re.findall(rf"\b\w+\[{G},{T},\d+\]", hlo)))}


def main(parts: list[str]) -> None:
    device = gpu_devices(1, "h100")[0]
    for name, f, operands in attempts():
        if not parts or any(p in name for p in parts):
            print(json.dumps(measure(name, f, operands, device)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
