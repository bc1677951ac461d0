"""maxmoe's one wrapper of tokamax's public API (`pip install -e ".[cuda]"`, Python >= 3.12):
the Mosaic GPU grouped GEMM (`moe.grouped_matmul=tokamax`) and flash attention
(`attention.implementation=tokamax`) on NVIDIA GPUs, SM80 to SM100.

Each call passes tokamax exactly one implementation ("mosaic"): given a list, or a kernel that
does not apply, tokamax falls back to its XLA path, which for ragged_dot is XLA's dense
expansion (every row through every expert) and for attention the S x S scores. Where the Mosaic
kernel does not apply, maxmoe stops with one line (ConfigError) instead, forward or backward.

Tokamax picks its kernels from jax's default device. On a GPU host that is the GPU; in a
deviceless compile (plan/gpu_aot.py) it is the host's CPU, so the lowering runs inside
`kernel_device(mesh devices)`, which is `jax.default_device` of a topology device (tokamax's
`config.cross_compile` alone leaves the device CPU, and tokamax then rejects it).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from collections.abc import Iterator, Sequence

import jax
import jax.extend.backend
import jax.numpy as jnp

from maxmoe.config import ConfigError
from maxmoe.sharding import current_mesh, mesh_device, spec

INSTALL = 'pip install -e ".[cuda]" on Python >= 3.12'
DTYPES = (jnp.bfloat16, jnp.float16)  # the Mosaic kernels' operands (their backward's too)

# jax.lax.ragged_dot_general's layouts: the forward x [M, K] . w [G, K, N] with M ragged; the
# input gradient g [M, N] . w[G, K, N]^T; the weight gradient x^T g, M the ragged contracting dim
_FORWARD = jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0])
_INPUT_GRAD = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
_WEIGHT_GRAD = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])

log = logging.getLogger(__name__)


def nvidia_gpu(device=None) -> bool:
    """Whether `device` (default: sharding.mesh_device(), the devices the step is compiled
    for) is an NVIDIA GPU: the devices tokamax's Mosaic GPU kernels are for."""
    device = mesh_device() if device is None else device
    return device.platform == "gpu" and "NVIDIA" in getattr(device, "device_kind", "")


def refusal(dtype) -> str:
    """"" when the tokamax kernels take this step on the mesh's devices, else one line why not:
    not an NVIDIA GPU, operands not bfloat16/float16, or no tokamax here."""
    device = mesh_device()
    if not nvidia_gpu(device):
        return (f"tokamax's Mosaic GPU kernels run on NVIDIA GPUs; this step is compiled for "
                f"{getattr(device, 'device_kind', device.platform)}")
    if jnp.dtype(dtype) not in DTYPES:
        return (f"tokamax's Mosaic GPU kernels take bfloat16/float16 operands, not "
                f"{jnp.dtype(dtype).name} (precision.compute_dtype)")
    return "" if importlib.util.find_spec("tokamax") else f"tokamax is not installed: {INSTALL}"


def require(what: str, dtype) -> None:
    """Raises ConfigError `what: refusal(...)` unless the tokamax kernels take the step, or
    when jax's default device, which tokamax reads, is not an NVIDIA GPU (a deviceless
    lowering outside kernel_device)."""
    why = refusal(dtype)
    default = jax.extend.backend.get_default_device()
    if not why and not nvidia_gpu(default):
        why = (f"tokamax picks its kernels from jax's default device, here {default.platform}: "
               "lower a deviceless GPU compile inside kernels/tokamax_ops.kernel_device")
    if why:
        raise ConfigError(f"{what}: {why}")


@functools.cache
def _tokamax():
    try:
        # late: tokamax comes only with the cuda extra (Python >= 3.12) and pulls in xprof and
        # more; a CPU run never imports it
        import tokamax
    except ImportError as e:
        raise ConfigError(f"tokamax does not import ({e}): {INSTALL}") from None
    return tokamax


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


@contextlib.contextmanager
def kernel_device(devices: Sequence) -> Iterator[None]:
    """Around a lowering for `devices` (a mesh's devices, e.g. deviceless GPUs from
    plan/gpu_aot.gpu_devices): makes the first of them jax's default device when they are GPUs,
    so that tokamax picks its GPU kernels; otherwise changes nothing. Only the lowering needs
    it; compiling and running do not."""
    first = next(iter(devices))
    if first.platform != "gpu":
        yield
        return
    with jax.default_device(first):
        yield


# The kernels' TMA copies want the row count M a multiple of their row tile (SM90 64, SM100
# up to 128) or under one tile: Mosaic refuses 96 rows ("dimension 1 must have size smaller or a
# multiple of its tiling 64"; the weight gradient reads the rows transposed). _ragged pads the
ROW_TILE = 128  # rows to a multiple of it, past sum(sizes): outside every group, so no change


def _ragged(lhs, rhs, sizes, dims, what: str):
    """tokamax.ragged_dot_general with the one Mosaic implementation, in lhs's dtype; the ragged
    rows (lhs's, and rhs's for the weight gradient) padded to ROW_TILE, the result cut back."""
    m = lhs.shape[0]
    pad = -m % ROW_TILE
    if pad:
        lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
        if dims is _WEIGHT_GRAD:
            rhs = jnp.pad(rhs, ((0, pad), (0, 0)))
    try:
        out = _tokamax().ragged_dot_general(lhs, rhs, sizes, dims, implementation="mosaic",
                                            preferred_element_type=lhs.dtype)
    except NotImplementedError as e:
        raise ConfigError(f"moe.grouped_matmul=tokamax: tokamax's Mosaic GPU ragged_dot does not "
                          f"take the {what} ({lhs.dtype.name}{list(lhs.shape)} . "
                          f"{rhs.dtype.name}{list(rhs.shape)}): {_first_line(e)}") from None
    return out if dims is _WEIGHT_GRAD or not pad else out[:m]


def _rows_in_groups(x, sizes):
    """[M, 1] bool: the rows inside the groups (before sum(sizes))."""
    return (jnp.arange(x.shape[0]) < jnp.sum(sizes))[:, None]


@jax.custom_vjp
def ragged_dot(x, w, sizes):
    """jax.lax.ragged_dot(x [M, K], w [G, K, N], sizes [G] int32) -> [M, N] in x's dtype (rows
    of group g times w[g]; rows from sum(sizes) on are 0), as tokamax's Mosaic GPU grouped GEMM:
    the forward, the input gradient and the weight gradient (M the ragged contracting
    dimension) are each one grouped kernel (grouped_forward, grouped_input_grad,
    grouped_weight_grad), with no dense [G, M, ...] expansion. Traced for an NVIDIA GPU only
    (kernel_device in a deviceless compile); ConfigError where the kernel does not apply."""
    return grouped_forward(x, w, sizes)


def grouped_forward(x, w, sizes):
    """x [M, K] . w [G, K, N] -> [M, N] in x's dtype, one Mosaic kernel. The kernels leave
    rows outside the groups unwritten (tokamax's zero_initialize is TPU-only), so they are
    zeroed here (and in grouped_input_grad): lax.ragged_dot gives 0 there."""
    return jnp.where(_rows_in_groups(x, sizes), _ragged(x, w, sizes, _FORWARD, "forward"), 0)


def grouped_input_grad(g, w, sizes):
    """g [M, N] . w [G, K, N]^T -> [M, K] in g's dtype, rows outside the groups 0: one kernel."""
    inside = _rows_in_groups(g, sizes)
    g = jnp.where(inside, g, 0)
    return jnp.where(inside, _ragged(g, w, sizes, _INPUT_GRAD, "input gradient"), 0)


def grouped_weight_grad(x, g, sizes):
    """x [M, K]^T g [M, N] per group -> [G, K, N] in x's dtype: one kernel over M, the ragged
    contracting dimension; g's rows outside the groups are zeroed first (the kernel masks x's
    rows only, and 0 * inf would be NaN)."""
    g = jnp.where(_rows_in_groups(g, sizes), g, 0)
    return _ragged(x, g, sizes, _WEIGHT_GRAD, "weight gradient")


def _ragged_fwd(x, w, sizes):
    return grouped_forward(x, w, sizes), (x, w, sizes)


def _ragged_bwd(res, g):
    x, w, sizes = res
    g = g.astype(x.dtype)
    dx = grouped_input_grad(g, w, sizes)
    return dx, grouped_weight_grad(x, g, sizes).astype(w.dtype), None


ragged_dot.defvjp(_ragged_fwd, _ragged_bwd)


def document_mask(segment_ids):
    """[B, S] segment ids -> [B, 1, S, S] bool (1 byte an element): query i may see key j of
    its own document; tokamax's public attention takes no segment ids, and causality rides
    on is_causal."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def _attention(q, k, v, mask, scale):
    try:
        return _tokamax().dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=scale,
                                                implementation="mosaic")
    except NotImplementedError as e:
        raise ConfigError(f"attention.implementation=tokamax: tokamax's Mosaic GPU attention "
                          f"does not take q {q.dtype.name}{list(q.shape)}, k {list(k.shape)}, "
                          f"v {list(v.shape)}: {_first_line(e)}") from None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def flash_attention(q, k, v, mask, scale: float):
    """Causal softmax attention inside documents with tokamax's Mosaic GPU flash attention:
    q [B, S, H, Dh], k [B, T, K, Dh], v [B, T, K, Dv] (H a multiple of K; Dv may differ from
    Dh, as MLA's 128 from its 192), mask [B, 1, S, T] bool (document_mask) -> [B, S, H, Dv] in
    q's dtype. scale: the softmax scale. No S x S float scores; ConfigError (one line) where
    the kernel, forward or backward, does not take the shapes."""
    return _attention(q, k, v, mask, scale)


def _flash_fwd(q, k, v, mask, scale):
    out, pull = jax.vjp(lambda q, k, v: _attention(q, k, v, mask, scale), q, k, v)
    return out, pull


def _flash_bwd(scale, pull, g):
    try:
        dq, dk, dv = pull(g)
    except NotImplementedError as e:
        raise ConfigError(f"attention.implementation=tokamax: tokamax's Mosaic GPU attention "
                          f"backward does not take these shapes: {_first_line(e)}") from None
    return dq, dk, dv, None


flash_attention.defvjp(_flash_fwd, _flash_bwd)


def attention(q, k, v, segment_ids, scale: float):
    """flash_attention of q [B, S, H, Dh], k [B, T, K, Dh], v [B, T, K, Dv] with segment ids
    [B, S] (causal, never across documents) -> [B, S, H, Dv], on the current mesh: a Mosaic
    kernel is one custom call that XLA cannot split, so under a mesh it runs in a shard_map
    over the batch and head axes the rules give q (sharding.spec), each device on its own
    rows and heads, with the [B, 1, S, S] document mask of its own rows. Key/value heads
    that the head axes do not divide are repeated to H first. ConfigError where the rules
    split the sequence (every query needs all keys)."""
    require("attention.implementation=tokamax", q.dtype)
    mesh = current_mesh()
    if mesh is None or mesh.size == 1:
        return flash_attention(q, k, v, document_mask(segment_ids), scale)
    logical = ("batch", "seq", "act_heads", None)
    q_spec = spec(logical, shape=q.shape)
    if q_spec[1] is not None:
        raise ConfigError("attention.implementation=tokamax: the rules split the sequence "
                          f"({q_spec[1]}); flash attention needs each query's keys on its device")
    if spec(logical, shape=k.shape)[2] != q_spec[2]:
        k, v = (jnp.repeat(a, q.shape[2] // a.shape[2], axis=2) for a in (k, v))
    qkv = jax.sharding.PartitionSpec(*q_spec[:3], None)
    rows = jax.sharding.PartitionSpec(q_spec[0], None)

    # check_vma off, as in parallel/experts.py: under the pipeline's vmap the varying-axes
    # inference wrongly flags outputs as varying over the stage axis
    @functools.partial(jax.shard_map, in_specs=(qkv, qkv, qkv, rows), out_specs=qkv,
                       check_vma=False)
    def body(q, k, v, segment_ids):
        return flash_attention(q, k, v, document_mask(segment_ids), scale)
    return body(q, k, v, segment_ids)


_LOGGED: set[tuple[str, str]] = set()


def log_kernel(part: str, kernel: str) -> None:
    """Logs once per process which kernel a model part was traced with (e.g. "moe grouped
    matmul", "tokamax"); plan.json counts what each compiled to (plan/probe.kernel_calls)."""
    if (part, kernel) not in _LOGGED:
        _LOGGED.add((part, kernel))
        log.info("%s: %s kernel", part, kernel)
