"""kernels/tokamax_ops.py, the one wrapper of tokamax, on CPU: which kernel `auto` resolves to
on each kind of device, the one-line refusals, and the wrapper's own math (the three ragged
dots of the custom VJP, the rows the Mosaic kernel leaves unwritten, the attention's
shard_map and document mask) against a stand-in tokamax built from jax.lax. The real Mosaic
kernels compile in tests/plan/test_gpu_train_step.py (deviceless XLA:GPU)."""

import importlib.util
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe import sharding
from maxmoe.config import DEFAULT_RULES, MESH_AXES, ConfigError
from maxmoe.kernels import tokamax_ops
from maxmoe.kernels.attention import attention_core, resolve_implementation
from maxmoe.kernels.fp8_ragged import dequantised_ragged_dot, fp8_ragged_dot
from maxmoe.kernels.grouped_matmul import dropless_local, resolve_kernel
from maxmoe.sharding import make_mesh, use_mesh
from tests.kernels.test_fp8 import unaligned_groups

H100 = "NVIDIA H100 80GB HBM3"


def _fake_mesh(platform: str, kind: str = ""):
    """A stand-in for a mesh of deviceless devices: only devices[...] platform/kind are read."""
    device = SimpleNamespace(platform=platform, device_kind=kind)
    return SimpleNamespace(devices=np.array([device], dtype=object))


def _on(mesh):
    """Context: `mesh` current for sharding.mesh_device (the process's devices stay CPUs)."""
    class On:
        def __enter__(self):
            self.token = sharding._MESH.set(mesh)

        def __exit__(self, *exc):
            sharding._MESH.reset(self.token)
    return On()


def test_auto_resolves_per_device_dtype_and_fp8():
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert resolve_kernel("auto", bf16) == "blocked"  # no mesh: jax.devices(), CPUs here
    assert resolve_implementation("auto", bf16) == "einsum"
    with _on(_fake_mesh("gpu", H100)):
        assert resolve_kernel("auto", bf16) == "tokamax"
        assert resolve_kernel("auto", jnp.float16) == "tokamax"
        assert resolve_kernel("auto", f32) == "blocked"  # Mosaic takes bf16/f16 only
        assert resolve_implementation("auto", bf16) == "tokamax"
        assert resolve_implementation("auto", f32) == "einsum"
        assert resolve_kernel("ragged_dot", bf16) == "ragged_dot"  # a choice stays a choice
        assert resolve_implementation("fused", bf16) == "fused"
    with _on(_fake_mesh("gpu", "AMD Instinct MI300X")):  # not an NVIDIA GPU
        assert resolve_kernel("auto", bf16) == "ragged_dot"
        assert resolve_implementation("auto", bf16) == "einsum"
    with _on(_fake_mesh("cpu", "cpu")):
        assert resolve_kernel("auto", bf16) == "blocked"


def test_refusals_are_one_line(monkeypatch):
    with pytest.raises(ConfigError, match="run on NVIDIA GPUs") as e:
        tokamax_ops.require("moe.grouped_matmul=tokamax", jnp.bfloat16)
    assert "\n" not in str(e.value)
    with _on(_fake_mesh("gpu", H100)):
        assert "float32" in tokamax_ops.refusal(jnp.float32)
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "tokamax" else find_spec(name, *a))
        assert tokamax_ops.refusal(jnp.bfloat16) == \
            'tokamax is not installed: pip install -e ".[cuda]" on Python >= 3.12'
        monkeypatch.undo()
        if importlib.util.find_spec("tokamax"):  # installed: the default device is the CPU
            with pytest.raises(ConfigError, match="kernel_device"):
                tokamax_ops.require("attention.implementation=tokamax", jnp.bfloat16)


def test_tokamax_on_a_cpu_mesh_stops_in_one_line_never_falls_back():
    t, k, d, f, experts = 16, 2, 8, 16, 4
    x = jnp.ones((t, d), jnp.bfloat16)
    w = jnp.ones((experts, d, f), jnp.bfloat16)
    with pytest.raises(ConfigError, match="^moe.grouped_matmul=tokamax: .*NVIDIA GPUs"):
        dropless_local(x, jnp.zeros((t, k), jnp.int32), jnp.ones((t, k)), w, w,
                       jnp.ones((experts, f, d), jnp.bfloat16), 0, grouped_matmul="tokamax")


class FakeTokamax:
    """tokamax's two entry points as jax.lax computes them, with the Mosaic kernel's habit of
    leaving output rows outside the groups unwritten (NaN here), and a record of the calls."""

    def __init__(self):
        self.calls, self.rows = [], []

    def ragged_dot_general(self, lhs, rhs, sizes, dims, *, implementation,
                           preferred_element_type):
        contract = tuple(tuple(d) for d in dims.dot_dimension_numbers[0])
        self.calls.append(("ragged_dot", implementation, contract))
        self.rows.append(lhs.shape[0])
        out = jax.lax.ragged_dot_general(lhs, rhs, sizes, dims,
                                         preferred_element_type=preferred_element_type)
        if dims.rhs_group_dimensions:  # rows of the output are lhs's ragged rows
            inside = (jnp.arange(out.shape[0]) < jnp.sum(sizes))[:, None]
            out = jnp.where(inside, out, jnp.nan)
        return out

    def dot_product_attention(self, q, k, v, *, mask, is_causal, scale, implementation):
        self.calls.append(("attention", implementation, is_causal))
        k, v = (jnp.repeat(a, q.shape[2] // a.shape[2], axis=2) for a in (k, v))
        s = jnp.einsum("bshd,bthd->bhst", q, k, preferred_element_type=jnp.float32) * scale
        causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
        p = jax.nn.softmax(jnp.where(mask & causal, s, -1e30), axis=-1)
        return jnp.einsum("bhst,bthd->bshd", p.astype(v.dtype), v).astype(q.dtype)


@pytest.fixture
def fake(monkeypatch):
    fake = FakeTokamax()
    monkeypatch.setattr(tokamax_ops, "_tokamax", lambda: fake)
    return fake


def test_ragged_dot_three_grouped_calls_and_zero_rows_outside_groups(fake):
    """Values and both gradients equal lax.ragged_dot's autodiff exactly (float32), although
    the stand-in kernel leaves rows past sum(sizes) NaN; one implementation ("mosaic") per
    call: forward, input gradient, weight gradient (the ragged contracting dimension), each
    on the 24 rows padded to the kernel's row tile (Mosaic refuses 96 rows: the gpu_aot
    test_gpu_train_step.py::test_grouped_gemm_takes_rows_not_a_multiple_of_its_tile)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(24, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 8, 16)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(24, 16)), jnp.float32)
    sizes = jnp.array([5, 0, 7], jnp.int32)  # 12 of 24 rows in groups; an empty group
    got, pull = jax.vjp(lambda x, w: tokamax_ops.ragged_dot(x, w, sizes), x, w)
    want, pull_ref = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)
    np.testing.assert_array_equal(got, want)
    grads = pull(g)
    for a, b in zip(grads, pull_ref(g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(grads[0])[12:] == 0)
    assert fake.calls == [("ragged_dot", "mosaic", ((1,), (1,))),
                          ("ragged_dot", "mosaic", ((1,), (2,))),
                          ("ragged_dot", "mosaic", ((0,), (0,)))]
    assert fake.rows == [tokamax_ops.ROW_TILE] * 3


def _rel(got, ref):
    """Relative error of got against ref in the Frobenius norm."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(got - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("mode", ["tensorwise", "blockwise"])
def test_dequantised_ragged_dot_is_the_fp8_recipe_in_three_grouped_calls(fake, mode):
    """moe.grouped_matmul=tokamax under precision.fp8: float32 operands (so no 16-bit rounding
    of q * scale), unaligned groups (100, 0, 156, 40 of 384 rows), K 192 and N 160 (partial
    128-blocks), 88 rows past the groups 2^12 times larger (other shards' rows: in no amax).
    Values and both gradients equal fp8_ragged_dot's (the same E4M3 scales and tiles; rtol
    1e-5, atol 1e-5 x max), are within FP8 error of the float32 lax.ragged_dot autodiff
    (relative Frobenius error < 0.06), and run as three grouped calls, one per GEMM."""
    sizes, live, x, g, w = unaligned_groups(3)
    got = _value_and_grads(lambda a, b: dequantised_ragged_dot(a, b, sizes, mode), x, w, g)
    recipe = _value_and_grads(lambda a, b: fp8_ragged_dot(a, b, sizes, mode), x, w, g)
    exact = _value_and_grads(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x * live, w, g * live)
    for a, b, c in zip(got, recipe, exact, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))
        assert _rel(a, c) < 0.06, _rel(a, c)
    assert np.all(np.asarray(got[0])[296:] == 0) and np.all(np.asarray(got[1])[296:] == 0)
    assert fake.calls == [("ragged_dot", "mosaic", ((1,), (1,))),
                          ("ragged_dot", "mosaic", ((1,), (2,))),
                          ("ragged_dot", "mosaic", ((0,), (0,)))]


def _value_and_grads(f, x, w, g):
    y, pull = jax.vjp(f, x, w)
    return (y, *pull(g))


def test_tokamax_under_fp8_runs_the_dequantised_path_in_bf16(fake, monkeypatch):
    """dropless_local with grouped_matmul=tokamax and precision.fp8=blockwise in bfloat16 (3
    grouped calls forward, 6 backward): its output and input gradient are as far from the
    float32 MLP without FP8 (lax.ragged_dot on the same values) as fp8_ragged_dot's (the
    ragged_dot kernel's FP8) are, to within 10% of that error (about 0.06-0.08 relative,
    Frobenius; bf16 alone would be ~10x closer): the FP8 rounding is applied, and the bf16
    rounding of q * scale adds little to it."""
    monkeypatch.setattr(tokamax_ops, "require", lambda *a, **k: None)
    t, k, d, f, experts = 64, 2, 256, 128, 4
    ks = jax.random.split(jax.random.key(7), 5)
    x = jax.random.normal(ks[0], (t, d), jnp.bfloat16)
    idx = jax.random.randint(ks[1], (t, k), 0, experts)
    wts = jax.nn.softmax(jax.random.normal(ks[2], (t, k)), axis=-1)
    wg, wu = (jax.random.normal(kk, (experts, d, f), jnp.bfloat16) * 0.1 for kk in ks[3:5])

    def run(kernel, fp8, dtype=jnp.bfloat16):
        w = [a.astype(dtype) for a in (wg, wu, jnp.swapaxes(wg, 1, 2))]

        def loss(x):
            out = dropless_local(x, idx, wts, *w, 0, grouped_matmul=kernel, fp8=fp8)
            return jnp.sum(out * out), out
        (_, out), dx = jax.value_and_grad(loss, has_aux=True)(x.astype(dtype))
        return out, dx
    exact = run("ragged_dot", "none", jnp.float32)
    for a, b, c in zip(run("tokamax", "blockwise"), run("ragged_dot", "blockwise"), exact,
                       strict=True):
        ratio = _rel(a, c) / _rel(b, c)
        assert 0.9 < ratio < 1.1 and _rel(b, c) < 0.1, (_rel(a, c), _rel(b, c))
    assert len(fake.calls) == 9 and {c[1] for c in fake.calls} == {"mosaic"}


def _qkv(b=2, s=16, h=4, kv=2, dh=24, dv=16, seed=0):
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.normal(size=(b, s, n, dh)), jnp.float32) for n in (h, kv))
    v = jnp.asarray(rng.normal(size=(b, s, kv, dv)), jnp.float32)
    seg = np.ones((b, s), np.int32)
    seg[0, 6:] = 2  # two documents in row 0
    seg[1, 11:] = 3
    return q, k, v, jnp.asarray(seg)


def _reference(q, k, v, seg, scale):
    """kernels/attention.attention_core (einsum, query blocks) in its [B, K, G, S, D] layout."""
    b, s, h, dh = q.shape
    kv = k.shape[2]
    qg = (q * scale).reshape(b, s, kv, h // kv, dh).transpose(0, 2, 3, 1, 4)
    out = attention_core(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), seg, 8)
    return out.reshape(b, h, s, -1).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("kv", [2, 1])  # kv 1: the tensor axis does not divide the kv heads
def test_attention_shard_map_matches_einsum_attention(fake, monkeypatch, kv):
    """tokamax_ops.attention on a 2 data x 2 fsdp x 2 tensor CPU mesh (its shard_map, the
    per-shard document mask, kv heads repeated where the head axis does not divide them; Dv
    16 != Dh 24 as MLA) equals the einsum kernel, values and gradients, float32."""
    monkeypatch.setattr(tokamax_ops, "require", lambda *a, **k: None)
    q, k, v, seg = _qkv(kv=kv)
    scale = 24 ** -0.5
    g = jnp.asarray(np.random.default_rng(1).normal(size=(*q.shape[:3], 16)), jnp.float32)
    mesh = make_mesh({a: dict(data=2, fsdp=2, tensor=2).get(a, 1) for a in MESH_AXES})
    with use_mesh(mesh, DEFAULT_RULES):
        got, pull = jax.vjp(jax.jit(lambda q, k, v: tokamax_ops.attention(q, k, v, seg, scale)),
                            q, k, v)
        grads = pull(g)
    want, pull_ref = jax.vjp(lambda q, k, v: _reference(q, k, v, seg, scale), q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, pull_ref(g), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert {c for c in fake.calls} == {("attention", "mosaic", True)}


def test_kernel_device_leaves_cpu_lowerings_alone():
    before = jax.config.jax_default_device
    with tokamax_ops.kernel_device(jax.devices()):
        assert jax.config.jax_default_device == before
