"""FP8 (E4M3) training matmuls: quantise/dequantise and a linear whose three GEMMs (forward,
input gradient, weight gradient) all run on E4M3 operands with float32 accumulation.

Modes (precision.fp8):
- `tensorwise`: one scale per operand tensor, *current* scaling (the amax of this very tensor,
  taken when it is quantised; no amax history, so no scale state in the train state). The
  tensor is the whole logical one: under GSPMD jnp.max already spans every shard; inside
  shard_map the grouped expert kernels reduce their amax over `AmaxAxes` (Transformer Engine's
  amax reduction), so the scales, and the loss, do not depend on the layout.
- `blockwise`: DeepSeek-V3's fine-grained recipe: activations and output gradients in 1x128
  tiles (per token, per 128 channels), weights in 128x128 blocks, and for the weight-gradient
  GEMM both operands in 128x1 tiles along the token dim. The contraction runs one 128-wide
  block at a time, each partial product scaled and summed in float32 (DeepSeek's promotion to
  FP32 every 128 elements). A dim that is not a multiple of 128 ends in a partial block: its
  scale is the amax of the elements it has (V3's 64-wide RoPE key, its 576-wide kv_a).

Scales are float32, scale = amax / 448 (E4M3's largest finite value), 1 for an all-zero block;
x ~ q * scale. E4M3 for gradients too (as DeepSeek-V3). Where the modes apply (attention
projections, dense MLPs, shared and routed experts, never embedding / LM head / router / norms /
attention core) is the model's business: it calls `project` at each projection.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec as P

from maxmoe.sharding import current_mesh, mesh_axes

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128  # DeepSeek-V3's tile / block edge
MODES = ("none", "tensorwise", "blockwise")


@dataclasses.dataclass(frozen=True)
class AmaxAxes:
    """The mesh axes (manual, inside shard_map) over which a tensorwise amax is reduced so that
    one scale covers the whole logical tensor: rows, the axes that split an activation (its
    rows, or its F dim for the expert MLP's hidden); weights, the axes that split an expert
    weight (its F dim). Empty: the local arrays are the whole tensors."""
    rows: tuple[str, ...] = ()
    weights: tuple[str, ...] = ()


NO_AXES = AmaxAxes()


def scale_of(amax: jax.Array, axes: tuple[str, ...] = ()) -> jax.Array:
    """float32 scale(s) of an amax: amax / 448, 1 where it is 0; the amax first reduced (pmax)
    over the manual mesh axes `axes`."""
    amax = jax.lax.pmax(amax, axes) if axes else amax
    return jnp.where(amax > 0, amax / E4M3_MAX, 1.0)


def expert_scales(w: jax.Array, axes: tuple[str, ...] = ()) -> jax.Array:
    """Tensorwise scales of stacked expert weights w [E, ...]: float32 [E], one per expert, each
    amax reduced over the mesh axes `axes` that split it."""
    return scale_of(jnp.max(jnp.abs(w.astype(jnp.float32)), axis=tuple(range(1, w.ndim))), axes)


def quantize_with(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x / scale in E4M3, clipped to +-448 (scale broadcast against x)."""
    return jnp.clip(x.astype(jnp.float32) / scale, -E4M3_MAX, E4M3_MAX).astype(E4M3)


def round_e4m3(v: jax.Array) -> jax.Array:
    """v (float32, within +-448) rounded to the nearest float8_e4m3fn value, ties to even, in
    float32: what v.astype(E4M3).astype(float32) gives, bit for bit, but in ops XLA keeps.
    XLA:GPU drops a convert to E4M3 and straight back (xla_allow_excess_precision, on by
    default), which would drop the rounding itself. Subnormals (|v| < 2^-6) sit on the 2^-9
    grid; normals keep 3 mantissa bits (reduce_precision with 5 exponent bits never
    overflows or flushes in E4M3's range)."""
    v = v.astype(jnp.float32)
    return jnp.where(jnp.abs(v) < 2.0 ** -6, jnp.round(v * 512.0) / 512.0,
                     jax.lax.reduce_precision(v, exponent_bits=5, mantissa_bits=3))


def rounded_with(x: jax.Array, scale: jax.Array) -> jax.Array:
    """quantize_with(x, scale) dequantised, float32: x as an FP8 GEMM with this scale sees it,
    computed with round_e4m3 so that XLA:GPU keeps the rounding."""
    return round_e4m3(jnp.clip(x.astype(jnp.float32) / scale, -E4M3_MAX, E4M3_MAX)) * scale


def tensorwise_matmul(a: jax.Array, sa: jax.Array, b: jax.Array, sb: jax.Array) -> jax.Array:
    """a [M, K] @ b [K, N] on E4M3 operands quantised with the given scalar scales sa, sb (the
    scales of whole tensors that a and b are parts of), float32 result."""
    return jnp.dot(quantize_with(a, sa), quantize_with(b, sb),
                   preferred_element_type=jnp.float32) * (sa * sb)


def quantize(x: jax.Array, tile: tuple[int, int] | None) -> tuple[jax.Array, jax.Array]:
    """x [M, N] -> (q [M, N] float8_e4m3fn, scale [ceil(M/r), ceil(N/c)] float32) for tiles of
    (r, c) elements (None: one tile, the whole tensor); x ~ q * scale of its tile. Partial
    tiles at the ends take the amax of the elements they hold."""
    return _tiled(x, tile, quantize_with)


def round_trip(x: jax.Array, tile: tuple[int, int]) -> jax.Array:
    """x [M, N] as quantize(x, tile) and dequantize would give it back, float32, in ops that
    XLA:GPU keeps (rounded_with)."""
    return _tiled(x, tile, rounded_with)[0]


def _tiled(x, tile, per_tile):
    """(per_tile(tiles of x, their scales) as [M, N], scale [ceil(M/r), ceil(N/c)]) for
    quantize's tiles."""
    m, n = x.shape
    r, c = tile if tile is not None else (m, n)
    mb, nb = -(-m // r), -(-n // c)
    xp = jnp.pad(x.astype(jnp.float32), ((0, mb * r - m), (0, nb * c - n)))
    tiles = xp.reshape(mb, r, nb, c)
    scale = scale_of(jnp.max(jnp.abs(tiles), axis=(1, 3)))
    q = per_tile(tiles, scale[:, None, :, None])
    return q.reshape(mb * r, nb * c)[:m, :n], scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def e4m3_wire(move, back, x: jax.Array, *args) -> jax.Array:
    """Token rows x [..., D] sent over a collective in E4M3, DeepSeek-V3's FP8 dispatch (3.3):
    quantised in 1x128 tiles (one float32 scale, amax / 448, per 128 elements of a row's D),
    the float8_e4m3fn payload [..., D] and the scales [..., ceil(D / 128)] each moved by
    move(a, *args) (a collective over the leading dims: an all-to-all, all-gather, ...),
    dequantised into x.dtype on arrival: [moved ..., D]. move None: no collective, x rounded
    in place the same way (round_trip, which XLA:GPU keeps), so a layout whose tokens do not
    travel computes the same values as one whose tokens do.
    Scales float32, not bfloat16: the blockwise expert GEMM requantises the arrived rows in
    the same 1x128 tiles, and with the tile's own scale that gives back the same E4M3 values
    (so FP8 dispatch adds no error there beyond one rounding of q * scale to x.dtype); a
    bfloat16 scale would move every value of a tile by up to 2^-9. They cost 4 bytes per 128
    of payload: the wire carries (1 + 4/128) / 2 of x's bytes in bfloat16.
    Backward: straight-through (DeepSeek-V3: the combine and the gradients stay BF16): the
    cotangent [moved ..., D] travels back by back(g, *args), move's transpose, unquantised in
    its own dtype (x.dtype), and the rounding passes it to x unchanged. args: arrays move
    reads (sizes, offsets), no gradient."""
    if move is None:
        return round_trip(x.reshape(-1, x.shape[-1]), (1, BLOCK)).astype(x.dtype).reshape(x.shape)
    q, scale = quantize(x.reshape(-1, x.shape[-1]), (1, BLOCK))
    q, scale = (move(a.reshape(*x.shape[:-1], -1), *args) for a in (q, scale))
    flat = dequantize(q.reshape(-1, q.shape[-1]), scale.reshape(-1, scale.shape[-1]),
                      (1, BLOCK), x.dtype)
    return flat.reshape(q.shape)


def _e4m3_wire_fwd(move, back, x, *args):
    return e4m3_wire(move, back, x, *args), (args, jnp.zeros((0,), x.dtype))


def _e4m3_wire_bwd(move, back, res, g):
    args, dtype = res
    g = g.astype(dtype.dtype)
    return (g if back is None else back(g, *args), *(None for _ in args))


e4m3_wire.defvjp(_e4m3_wire_fwd, _e4m3_wire_bwd)


def expand_scale(scale: jax.Array, tile: tuple[int, int], shape: tuple[int, int]) -> jax.Array:
    """A [Mb, Nb] tile scale -> [M, N], each element its tile's scale."""
    full = jnp.repeat(jnp.repeat(scale, tile[0], axis=0), tile[1], axis=1)
    return full[:shape[0], :shape[1]]


def dequantize(q: jax.Array, scale: jax.Array, tile: tuple[int, int] | None,
               dtype=jnp.float32) -> jax.Array:
    """quantize's inverse: q [M, N] E4M3 and its tile scales -> q * scale in dtype."""
    tile = tile if tile is not None else q.shape
    return (q.astype(jnp.float32) * expand_scale(scale, tile, q.shape)).astype(dtype)


def round_trip_row_tiles(x: jax.Array, tile: jax.Array, num_tiles: int) -> jax.Array:
    """x [M, N] -> dequantize(quantize(x)) in float32 with tiles given per row: the elements of
    column j in rows with tile id t share a scale (their amax / 448), so tile ids make 128x1
    token tiles that follow group boundaries (a ragged weight gradient's). tile [M] int in
    [0, num_tiles]; rows with id num_tiles (padding) come back as zeros and count in no amax.
    Computed with rounded_with, so XLA:GPU keeps the rounding."""
    live = (tile < num_tiles)[:, None]
    x = jnp.where(live, x.astype(jnp.float32), 0.0)
    amax = jax.ops.segment_max(jnp.abs(x), tile, num_segments=num_tiles + 1,  # [tiles + 1, N]
                               indices_are_sorted=True)
    scale = scale_of(amax)[tile]
    return rounded_with(x, scale)


def fp8_matmul(a: jax.Array, b: jax.Array, mode: str, b_tile: int = BLOCK,
               groups: int | None = None) -> jax.Array:
    """a [M, K] @ b [K, N] on E4M3 operands, float32 result (not differentiable: fp8_dot and
    the grouped kernels write the backward). tensorwise: one scale per operand, the float32
    product rescaled once. blockwise: a in 1x128 tiles (per row, per 128 of K), b in
    128 x b_tile blocks (128x128 for a weight; 1 for the weight gradient's 128x1 token tiles),
    one 128-wide K block at a time, each partial product scaled and summed in float32.
    groups: token_tiled_matmul's, for the weight gradient's token tiles."""
    if mode == "blockwise" and b_tile == 1:
        return token_tiled_matmul(a, b, groups)
    qb, sb = quantize(b, _tile(mode, (BLOCK, b_tile)))
    return scaled_matmul(a, qb, sb, mode, b_tile)


def token_tiled_matmul(a: jax.Array, b: jax.Array, groups: int | None = None) -> jax.Array:
    """a [P, M] @ b [M, N] -> float32 [P, N], both operands in E4M3 128x1 tiles along M (the
    weight gradient's token tiles: scale per 128 tokens, per column of either operand), each
    tile's product scaled and summed in float32. M's tiles are laid out as [G, C] with G
    = gcd(tiles, the devices the tokens are split over: `groups`, by default
    `token_devices()` where this traces): the token sharding lands on G, each device sums its
    own tiles over C and XLA adds the G partial sums once at the end, instead of replicating
    the token-sharded operands to slice their tiles (issue 28). The same tiles and products
    as quantize / scaled_matmul."""
    (p, m), n = a.shape, b.shape[1]
    t = -(-m // BLOCK)
    g = math.gcd(t, token_devices() if groups is None else groups)
    c = t // g
    a4 = _sharded_but(jnp.pad(a, ((0, 0), (0, t * BLOCK - m))).reshape(p, g, c, BLOCK), 2)
    b4 = _sharded_but(jnp.pad(b, ((0, t * BLOCK - m), (0, 0))).reshape(g, c, BLOCK, n), 1)
    qa, sa = _quantize_along(a4, 3)  # sa [P, G, C, 1]
    qb, sb = _quantize_along(b4, 2)  # sb [G, C, 1, N]
    sa = jnp.moveaxis(sa[..., 0], 0, -1)  # [G, C, P]

    def tile(j, acc):
        part = jnp.einsum("pgk,gkn->gpn", qa[:, :, j], qb[:, j],
                          preferred_element_type=jnp.float32)
        return acc + part * sa[:, j, :, None] * sb[:, j]
    acc = jax.lax.fori_loop(0, c, tile, jnp.zeros((g, p, n), jnp.float32), unroll=c <= 8)
    return acc[0] if g == 1 else acc.sum(0)


def _quantize_along(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
    """x -> (q E4M3, scale float32 with axis kept at size 1): one scale per slice along
    axis, as quantize's tiles (amax / 448, 1 for all zeros)."""
    scale = scale_of(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True))
    return quantize_with(x, scale), scale


def _tile(mode: str, tile: tuple[int, int]) -> tuple[int, int] | None:
    """The tile of a blockwise operand; None (the whole tensor) for tensorwise."""
    assert mode in ("tensorwise", "blockwise"), mode
    return tile if mode == "blockwise" else None


def scaled_matmul(a: jax.Array, qb: jax.Array, sb: jax.Array, mode: str,
                  b_tile: int = BLOCK) -> jax.Array:
    """fp8_matmul with b already quantised (qb [K, N] E4M3, sb its scales in 128 x b_tile
    blocks, or [1, 1] for tensorwise): a is quantised here. float32 [M, N]."""
    if mode == "tensorwise":
        return _whole_product(*quantize_whole(a), qb, sb)
    (m, k), n = a.shape, qb.shape[1]
    kb = -(-k // BLOCK)
    qa, sa = quantize(a, (1, BLOCK))  # sa [M, KB]
    sb = expand_scale(sb, (1, b_tile), (kb, n))  # [KB, N]
    if kb == 1:
        return jnp.dot(qa, qb, preferred_element_type=jnp.float32) * sa * sb
    # the loop slices the block dim: keep it whole on every device, or GSPMD shards the
    # loop's operands over it and then replicates them to slice (issue 28)
    qa = _sharded_but(jnp.pad(qa, ((0, 0), (0, kb * BLOCK - k))).reshape(m, kb, BLOCK), 1)
    qb = _sharded_but(jnp.pad(qb, ((0, kb * BLOCK - k), (0, 0))).reshape(kb, BLOCK, n), 0)
    sa, sb = _sharded_but(sa, 1), _sharded_but(sb, 0)

    def block(i, acc):
        part = jnp.dot(qa[:, i], qb[i], preferred_element_type=jnp.float32)
        return acc + part * sa[:, i, None] * sb[i][None, :]
    return jax.lax.fori_loop(0, kb, block, jnp.zeros((m, n), jnp.float32), unroll=kb <= 8)


def quantize_whole(x: jax.Array, axes: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """quantize(x, None) with the amax reduced (pmax) over the manual mesh axes `axes`, so the
    scale is the whole tensor's: (q, scale [1, 1])."""
    scale = scale_of(jnp.max(jnp.abs(x.astype(jnp.float32))), axes)
    return quantize_with(x, scale), scale.reshape(1, 1)


def _partitioned_devices() -> int:
    """Devices of the current mesh when XLA partitions it (all axes Auto); 1 without a mesh
    or inside shard_map (manual axes), where arrays are local."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or any(t != AxisType.Auto for t in mesh.axis_types):
        return 1
    return mesh.size


def token_devices() -> int:
    """The devices an XLA-partitioned step splits the tokens over: those of the mesh axes the
    current rules map "batch" and "seq" to (sharding.mesh_axes: inside a vmap over replicas or
    stages those axes are the vmap's, not the rows'), the whole mesh without maxmoe's rules, 1 where
    `_partitioned_devices` is. Read in the forward trace (fp8_dot's `groups`): a custom VJP's
    backward traces after the forward's contexts have closed. Why: a G larger than the rows'
    split is not sharded, and each device kept G float32 partial weight gradients (671B FP8:
    [32, 18432, 7168], 15.75 GiB)."""
    devices = _partitioned_devices()
    if devices == 1 or current_mesh() is None:
        return devices
    return math.prod(current_mesh().shape[a] for a in {*mesh_axes("batch"), *mesh_axes("seq")})


def _sharded_but(x: jax.Array, dim: int) -> jax.Array:
    """x with dim unsharded (a sharding constraint; the other dims left to XLA), so a loop
    can slice it without a reshard; x itself where `_partitioned_devices` is 1."""
    if _partitioned_devices() == 1:
        return x
    dims = [P.UNCONSTRAINED] * x.ndim
    dims[dim] = None
    return jax.lax.with_sharding_constraint(x, P(*dims))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def fp8_dot(x: jax.Array, w: jax.Array, mode: str, amax: AmaxAxes = NO_AXES,
            groups: int | None = None) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in x.dtype, the forward on E4M3 operands and the
    backward's input gradient (g @ w^T: g in 1x128 tiles, w in the forward's 128x128 blocks)
    and weight gradient (x^T @ g: both in 128x1 tiles along the tokens) too; float32
    accumulation throughout (fp8_matmul). mode: tensorwise | blockwise.
    Residuals: the forward's quantised w and its scales (the input gradient reuses them, so
    the weight is quantised, and under FSDP gathered, once per step), and x itself (blockwise:
    its token tiles differ from the forward's) or, tensorwise, x in E4M3 with its scale.
    amax: inside shard_map, the mesh axes a tensorwise amax spans (x and g: amax.rows; w:
    amax.weights); under GSPMD the amax spans every shard already. groups: the devices x's
    tokens are split over (token_devices() where the caller traces; None: read in the
    backward), for the weight gradient's partial sums (token_tiled_matmul)."""
    return _fp8_dot_fwd(x, w, mode, amax, groups)[0]


def _fp8_dot_fwd(x, w, mode, amax, groups):
    x2 = x.reshape(-1, x.shape[-1])
    if mode == "tensorwise":  # x quantised once: for the product and as the residual
        qw, sw = quantize_whole(w, amax.weights)
        xres = quantize_whole(x2, amax.rows)
        y = _whole_product(*xres, qw, sw)
    else:
        qw, sw = quantize(w, (BLOCK, BLOCK))
        y, xres = scaled_matmul(x2, qw, sw, mode), x2
    y = y.astype(x.dtype).reshape(*x.shape[:-1], w.shape[1])
    # zero-size arrays carry the dtypes (residuals must be arrays)
    return y, (xres, qw, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _fp8_dot_bwd(mode, amax, groups, res, g):
    xres, qw, sw, xdt, wdt = res
    g2 = g.reshape(-1, g.shape[-1])
    if mode == "tensorwise":  # g quantised once, for both products
        (qx, sx), (qg, sg) = xres, quantize_whole(g2, amax.rows)
        dx, dw = _whole_product(qg, sg, qw.T, sw.T), _whole_product(qx.T, sx, qg, sg)
    else:
        dx = scaled_matmul(g2, qw.T, sw.T, mode)
        dw = fp8_matmul(xres.T, g2, mode, b_tile=1, groups=groups)
    return dx.astype(xdt.dtype).reshape(*g.shape[:-1], qw.shape[0]), dw.astype(wdt.dtype)


def _whole_product(qa, sa, qb, sb):
    """qa @ qb of E4M3 operands with [1, 1] scales, rescaled: float32."""
    return jnp.dot(qa, qb, preferred_element_type=jnp.float32) * (sa[0, 0] * sb[0, 0])


fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def project(x: jax.Array, w: jax.Array, mode: str = "none", spec: str | None = None) -> jax.Array:
    """A projection: x @ w (spec None) or jnp.einsum(spec, x, w) when mode is none; otherwise
    the same contraction through fp8_dot, with x's contracted dims flattened in w's order and
    w as [contracted, free] (blocks run over the flattened dims, as in DeepSeek's [out, in]
    FP8 checkpoints). spec: a plain two-operand einsum, no ellipsis."""
    if mode == "none":
        return x @ w if spec is None else jnp.einsum(spec, x, w)
    if spec is None:
        return fp8_dot(x, w, mode, NO_AXES, token_devices())
    inputs, out = spec.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    contract = [c for c in rhs if c in lhs and c not in out]
    keep = [c for c in lhs if c not in contract]
    free = [c for c in rhs if c not in contract]
    size = dict(zip(lhs, x.shape, strict=True)) | dict(zip(rhs, w.shape, strict=True))
    xt = jnp.einsum(f"{lhs}->{''.join(keep + contract)}", x)
    xt = xt.reshape(*xt.shape[:len(keep)], -1)
    wt = jnp.einsum(f"{rhs}->{''.join(contract + free)}", w)
    y = fp8_dot(xt, wt.reshape(math.prod(size[c] for c in contract), -1), mode, NO_AXES,
                token_devices())
    y = y.reshape(*y.shape[:-1], *(size[c] for c in free))
    return jnp.einsum(f"{''.join(keep + free)}->{out}", y)
