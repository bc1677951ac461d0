"""FP8 dispatch (precision.fp8, either mode): the tokens travel to their experts as E4M3 1x128
tiles with float32 scales (kernels/fp8.e4m3_wire), the combine and the gradients in bfloat16.

References: a float64 NumPy rounding of 1x128 tiles to E4M3 (scale amax / 448, round to the
nearest E4M3 value, ties to even); the wire's values equal it within rtol 1e-6 (the float32
scale and division against float64), and differ from x by at most E4M3's half spacing,
max(2^-4 |x|, 2^-10 scale) (tests/kernels/test_fp8.py derives the bound). The gradient is
straight-through: exactly the cotangent moved back. The blockwise expert GEMM requantises the
arrived rows to the same E4M3 values, so FP8 dispatch moves its product by float32 rounding
only (rtol 1e-6); under tensorwise the wire's rounding comes on top of the GEMM's (within the
bound above). The equivalence rows against one device, which rounds its tokens in place, are
in tests/test_sharded_equivalence.py (FP8_LAYOUTS).

What goes on the wire is read from the HLO: XLA:CPU widens collective operands when it compiles
(bf16 to f32, f8e4m3fn to f16), so the CPU tests read the HLO jax hands to XLA (the same on
every backend); the gpu_aot test reads XLA:GPU's compiled HLO, which keeps f8e4m3fn.
"""

import functools
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxmoe.config import DEFAULT_RULES, MoEConfig
from maxmoe.kernels.fp8 import E4M3_MAX, e4m3_wire, fp8_matmul
from maxmoe.parallel.capacity import Capacity
from maxmoe.parallel.dispatch import AllGather, AllToAll, ExpertShards
from maxmoe.parallel.two_level import TwoLevel
from maxmoe.plan.gpu_aot import gpu_devices
from maxmoe.plan.hlo import operand_name, parse_instruction
from maxmoe.sharding import use_mesh

E, K, D, F, T = 8, 2, 384, 128, 64  # T tokens a device; D three 128-wide tiles (not K)
WIRE_RATIO = (1 + 4 / 128) / 2  # E4M3 payload + one float32 scale per 128, over bfloat16
EXCHANGES = ("all-to-all", "ragged-all-to-all", "all-gather", "reduce-scatter")


def e4m3_reference(x: np.ndarray) -> np.ndarray:
    """x [M, N] rounded in 1x128 tiles through E4M3 and back, float64: scale amax / 448 (1 for
    an all-zero tile), x / scale rounded to the nearest E4M3 value (3 mantissa bits above
    2^-6, the 2^-9 grid below), ties to even."""
    x = np.asarray(x, np.float64)
    out = np.empty_like(x)
    for j in range(0, x.shape[1], 128):
        tile = x[:, j:j + 128]
        amax = np.max(np.abs(tile), axis=1, keepdims=True)
        scale = np.where(amax > 0, amax / E4M3_MAX, 1.0)
        v = np.clip(tile / scale, -E4M3_MAX, E4M3_MAX)
        exp = np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** -6)))
        step = 2.0 ** (exp - 3)  # normals: 3 mantissa bits; subnormals: 2^-9
        out[:, j:j + 128] = np.round(v / step) * step * scale  # np.round: ties to even
    return out


def _wide(key, shape):
    """Normal values with row magnitudes over 2^-8 .. 2^8 and a few all-zero rows."""
    k1, k2 = jax.random.split(key)
    rows = 2.0 ** jax.random.uniform(k2, (shape[0], 1), minval=-8, maxval=8)
    return (jax.random.normal(k1, shape) * rows).at[::7].set(0.0)


def test_wire_rounding_is_1x128_e4m3_against_float64():
    """Rounded in place (no collective), in a 200-wide hidden (a partial second tile)."""
    x = _wide(jax.random.key(0), (96, 200))
    got = np.asarray(jax.jit(lambda a: e4m3_wire(None, None, a))(x), np.float64)
    ref = e4m3_reference(x)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0)
    xs = np.asarray(x, np.float64)
    scale = np.concatenate([np.repeat(np.max(np.abs(xs[:, j:j + 128]), 1, keepdims=True) / 448,
                                      min(128, 200 - j), 1) for j in (0, 128)], 1)
    assert np.all(np.abs(got - xs) <= np.maximum(2.0 ** -4 * np.abs(xs), 2.0 ** -10 * scale)
                  * (1 + 1e-6))
    assert np.any(got != xs)  # it did round


def test_wire_moves_e4m3_and_passes_the_gradient_straight_through():
    """An all-to-all over 8 devices: each device receives the rounded rows its peers sent it,
    and the gradient of x is the cotangent sent back unchanged (no rounding, x's dtype)."""
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    move = functools.partial(jax.lax.all_to_all, axis_name="expert", split_axis=0,
                             concat_axis=0, tiled=True)

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("expert"), out_specs=P("expert"))
    def wire(x):
        return e4m3_wire(move, move, x)  # this all_to_all is its own transpose
    x = _wide(jax.random.key(1), (8 * 16, D))
    cot = jax.random.normal(jax.random.key(2), x.shape)

    @jax.jit
    def run(x, cot):
        y, pull = jax.vjp(wire, x)
        return y, pull(cot)[0]
    y, gx = run(x, cot)
    # device i's block j came from device j's block i: a transpose of the [8, 8, 2, D] blocks
    perm = lambda a: np.asarray(a).reshape(8, 8, 2, D).transpose(1, 0, 2, 3).reshape(-1, D)  # noqa: E731
    np.testing.assert_allclose(np.asarray(y, np.float64), perm(e4m3_reference(x)), rtol=1e-6)
    np.testing.assert_array_equal(gx, perm(cot))
    assert gx.dtype == x.dtype


def test_blockwise_gemm_gives_the_same_product_on_wire_rows():
    """The blockwise GEMM's own 1x128 rounding of the arrived rows gives back the wire's E4M3
    values: the product moves by float32 rounding only (rtol 1e-6); tensorwise's one scale
    does not, so there FP8 dispatch adds the wire's rounding."""
    x = _wide(jax.random.key(3), (64, D))
    w = 0.1 * jax.random.normal(jax.random.key(4), (D, 96))
    wired = e4m3_wire(None, None, x)
    for mode, same in (("blockwise", True), ("tensorwise", False)):
        a, b = (np.asarray(jax.jit(fp8_matmul, static_argnums=2)(v, w, mode))
                for v in (x, wired))
        close = np.allclose(a, b, rtol=1e-6, atol=1e-6 * np.abs(a).max())
        assert close == same, mode


def _dispatcher(kind: str, fp8: str, grouped_matmul: str):
    cfg = MoEConfig(num_experts=E, experts_per_token=K, expert_mlp_size=F,
                    grouped_matmul=grouped_matmul,
                    dispatch="capacity" if kind == "capacity" else "dropless",
                    capacity_factor=2.0, transport="all_gather" if kind == "capacity" else kind)
    shards = ExpertShards(axes=("expert",), sizes=(8,), gathered=("expert",), sync=("expert",))
    if kind == "capacity":
        made = Capacity(cfg, shards, seq_len=T)
    elif kind == "two_level":  # 8 shards as 2 hosts x 4: hop 1 across, hop 2 inside
        made = TwoLevel(cfg, shards, hosts=2)
    else:
        made = {"all_gather": AllGather, "all_to_all": AllToAll}[kind](cfg, shards)
    made.fp8 = fp8
    return made


def _step_hlo(kind: str, fp8: str, mesh, compiled: bool, ragged: bool = False) -> str:
    """HLO of one MoE dispatch's forward and backward on 8 expert shards, bfloat16 rows."""
    # on GPU lax.ragged_dot (auto's tokamax picks its kernels from a real device)
    dispatcher = _dispatcher(kind, fp8, "ragged_dot" if ragged else "auto")
    if ragged:
        dispatcher.ragged = True

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("expert"),) * 6,
                       out_specs=P("expert"), check_vma=False)
    def body(x, idx, w, wg, wu, wd):
        return dispatcher(x, idx, w, wg, wu, wd).y
    rows = jax.sharding.NamedSharding(mesh, P("expert"))
    args = [jax.ShapeDtypeStruct(s, dt, sharding=rows) for s, dt in (
        ((8 * T, D), jnp.bfloat16), ((8 * T, K), jnp.int32), ((8 * T, K), jnp.float32),
        ((E, D, F), jnp.bfloat16), ((E, D, F), jnp.bfloat16), ((E, F, D), jnp.bfloat16))]
    with use_mesh(mesh, DEFAULT_RULES):  # capacity's exchange reads the current mesh
        lowered = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(body(*a).astype(jnp.float32)),
                                             argnums=(0, 3))).lower(*args)
    return lowered.compile().as_text() if compiled else lowered.as_text(dialect="hlo")


def exchanged_rows(hlo: str) -> list[tuple[str, int, int]]:
    """(dtype, elements, last dim) of the data operand of every token-row exchange (the
    all-to-all, all-gather and reduce-scatter kinds, async starts included) in the HLO whose
    operand is floating point and has a last dim of D or D / 128 (the rows, their scales)."""
    instrs = [ins for line in hlo.splitlines() if (ins := parse_instruction(line))]
    symbols = {ins.name: ins.type for ins in instrs}
    found = []
    for ins in instrs:
        if ins.opcode.removesuffix("-start") not in EXCHANGES:
            continue
        for op in ins.operands[:1] if "ragged" in ins.opcode else ins.operands:
            parts = op.rsplit(None, 1)
            shape = parts[0] if len(parts) == 2 else symbols[operand_name(op)]
            m = re.match(r"\(?(\w+)\[([\d,]+)\]", shape)
            dims = [int(d) for d in m.group(2).split(",")]
            if m.group(1)[0] in "fb" and dims[-1] in (D, D // 128):
                found.append((m.group(1), int(np.prod(dims)), dims[-1]))
    return found


def _wire_checks(rows_fp8, rows_bf16):
    """The FP8 run sends each dispatch as an E4M3 payload and float32 scales, one per 128 of a
    row, where the bfloat16 run sends one bfloat16 exchange of the payload's shape; its other
    token-row exchanges (the combine, every gradient) are the bfloat16 run's, dtypes included.
    The dispatch bytes (payload + scales) are WIRE_RATIO of bfloat16's."""
    payload = sorted(r for r in rows_fp8 if r[0] == "f8e4m3fn")
    scales = sorted(r for r in rows_fp8 if r[2] == D // 128)
    assert payload and len(scales) == len(payload), rows_fp8
    assert all(s[0] == "f32" and 128 * s[1] == r[1] for r, s in zip(payload, scales,
                                                                     strict=True)), rows_fp8
    dispatch = Counter(("bf16", r[1], D) for r in payload)
    assert dispatch <= Counter(rows_bf16), (rows_bf16, payload)
    assert Counter(rows_bf16) - dispatch == Counter(rows_fp8) - Counter(payload + scales)
    ratio = sum(r[1] + 4 * s[1] for r, s in zip(payload, scales, strict=True)) / sum(
        2 * r[1] for r in payload)
    assert abs(ratio - WIRE_RATIO) < 1e-12, ratio


@pytest.mark.parametrize("kind", ["all_to_all", "capacity", "all_gather", "two_level"])
def test_dispatch_sends_e4m3_and_float32_scales_on_8_devices(kind):
    """The HLO of forward and backward on 8 fake devices: the dispatched rows travel as
    f8e4m3fn with f32 scales, the combine and every gradient as without FP8 (bf16; AllGather's
    combine is its float32 reduce-scatter of partial sums), and the dispatch bytes are
    (1 + 4/128) / 2 of bfloat16's."""
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = [exchanged_rows(_step_hlo(kind, fp8, mesh, compiled=False))
            for fp8 in ("blockwise", "none")]
    _wire_checks(*rows)
    if kind == "two_level":  # hop 1 too (across hosts): [2 hosts, T, D] in E4M3
        assert ("f8e4m3fn", 2 * T * D, D) in rows[0], rows[0]


@pytest.mark.gpu_aot
def test_ragged_dispatch_sends_e4m3_in_the_gpu_compile():
    """XLA:GPU's compiled HLO on 8 deviceless H100s (the venv with jax[cuda12]; skipped
    without the plugin): the ragged-all-to-all of the dispatch keeps f8e4m3fn and f32
    operands (XLA does not fold the quantisation into the collective), the rest bf16."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="jax[cuda12] plugin not installed")
    mesh = jax.sharding.Mesh(gpu_devices(8, "h100"), ("expert",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    _wire_checks(*(exchanged_rows(_step_hlo("all_to_all", fp8, mesh, compiled=True,
                                            ragged=True))
                   for fp8 in ("blockwise", "none")))
