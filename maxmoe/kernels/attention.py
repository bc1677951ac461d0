"""Causal, document-masked softmax attention kernels, shared by GQA (model/attention.py) and
MLA (model/mla.py): `attention_core`, einsum attention in causal query blocks with its own
backward, `fused_attention`, jax.nn.dot_product_attention (cuDNN flash attention on GPU), and
tokamax's Mosaic GPU flash attention (kernels/tokamax_ops.attention); `resolve_implementation`
picks for `auto`. Arrays in, arrays out: no parameters, no sharding annotations (but tokamax's
shard_map)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxmoe.kernels import tokamax_ops
from maxmoe.sharding import mesh_platform


def attention_mask(segment_ids: jax.Array, lo: int = 0, hi: int | None = None) -> jax.Array:
    """[B, S] segment ids -> [B, 1, 1, hi - lo, hi] bool for queries lo:hi against keys :hi
    (default all S): causal and never across documents."""
    hi = segment_ids.shape[1] if hi is None else hi
    causal = jnp.arange(lo, hi)[:, None] >= jnp.arange(hi)[None, :]
    same_doc = segment_ids[:, lo:hi, None] == segment_ids[:, None, :hi]
    return (causal[None] & same_doc)[:, None, None]


MASKED = -1e30  # float32 score of a masked pair: exp underflows to exactly 0


def _bias(mask: jax.Array) -> jax.Array:
    """0.0 where mask, MASKED elsewhere: a lookup in a two-entry table, not a select. XLA keeps
    a gather's result in memory, read once per score, while it re-derived a select's mask (the
    segment-id and causal comparisons) inside every exp fusion reading it once the layers are
    unrolled (docs/performance/planning.md, Attention kernel)."""
    return jnp.asarray([MASKED, 0.0], jnp.float32)[mask.astype(jnp.int32)]


def query_blocks(s: int, block_size: int) -> list[tuple[int, int]]:
    """(lo, hi) of each block of `block_size` queries (0 or >= s: one block)."""
    size = block_size if 0 < block_size < s else s
    return [(lo, min(lo + size, s)) for lo in range(0, s, size)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                   block_size: int = 0) -> jax.Array:
    """Causal softmax attention that never crosses documents, in blocks of `block_size` queries.

    q [B, K, G, S, Dh] (softmax scale already applied), k [B, K, T, Dh], v [B, K, T, Dv] ->
    [B, K, G, S, Dv] in v's dtype; query head h = k*G + g uses kv head k (Hugging Face's
    repeat_kv order). Scores, softmax and its statistics in float32.

    A query block meets only the keys up to its own end, so the blocks above the diagonal are
    never computed: n blocks skip (n - 1) / 2n of the scores. The backward keeps q, k, v, the
    output and each row's log-sum-exp, not the probabilities: it recomputes them transposed
    (P^T = exp(K Q^T - lse)), so every backward matmul reads its operands in the layout
    XLA:CPU multiplies fastest, and the layer scan stacks no [B, H, S, T] tensor. That costs
    one more Q K^T product per block (7 attention matmuls instead of 6), and uses less memory
    and time than autodiff of the same blocks, which kept the probabilities and transposed them
    (docs/performance/planning.md, Attention kernel).
    """
    return _attention_fwd(q, k, v, segment_ids, block_size)[0]


def _merge(t: jax.Array) -> jax.Array:
    """[B, K, G, n, D] -> [B, K, G*n, D]: the query heads of a kv head as rows of one matrix.
    XLA:CPU lowered some 5-D forms badly (a [B, K, 1, S, D] row sum ran as one-row dots)."""
    return t.reshape(*t.shape[:2], -1, t.shape[-1])


def _block_bias(segment_ids, lo, hi, groups):
    """[B, 1, G*(hi - lo), hi] float32 for the merged rows of queries lo:hi: 0 where the query
    may see key j, MASKED elsewhere."""
    bias = _bias(attention_mask(segment_ids, lo, hi))  # [B, 1, 1, n, hi]
    return _merge(jnp.broadcast_to(bias, (bias.shape[0], 1, groups, *bias.shape[3:])))


def _block_bias_t(segment_ids, lo, hi, groups):
    """_block_bias transposed, [B, 1, hi, G*(hi - lo)], built in that layout (transposing the
    other made XLA:CPU's exp fusion of the backward read it column-wise, much slower)."""
    causal = jnp.arange(hi)[:, None] <= jnp.arange(lo, hi)[None, :]  # key j, query lo + i
    same_doc = segment_ids[:, :hi, None] == segment_ids[:, None, lo:hi]
    bias = _bias(causal[None] & same_doc)[:, :, None]  # [B, hi, 1, n]
    b, n = bias.shape[0], hi - lo
    return jnp.broadcast_to(bias, (b, hi, groups, n)).reshape(b, 1, hi, groups * n)


def _attention_fwd(q, k, v, segment_ids, block_size):
    f32 = jnp.float32
    b, kv, groups = q.shape[:3]
    outs, lses = [], []
    for lo, hi in query_blocks(q.shape[3], block_size):
        s = jnp.einsum("bkxd,bktd->bkxt", _merge(q[:, :, :, lo:hi]), k[:, :, :hi],
                       preferred_element_type=f32) + _block_bias(segment_ids, lo, hi, groups)
        m = jnp.max(s, axis=-1, keepdims=True)  # every row keeps its diagonal: m is finite
        e = jnp.exp(s - m)
        z = jnp.sum(e, axis=-1, keepdims=True)
        # normalise the [rows, Dv] output rather than the [rows, T] probabilities
        o = jnp.einsum("bkxt,bktd->bkxd", e.astype(v.dtype), v[:, :, :hi],
                       preferred_element_type=f32) / z
        outs.append(o.astype(v.dtype).reshape(b, kv, groups, hi - lo, -1))
        lses.append((m + jnp.log(z)).reshape(b, kv, groups, hi - lo))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    lse = lses[0] if len(lses) == 1 else jnp.concatenate(lses, axis=3)  # [B, K, G, S]
    return out, (q, k, v, segment_ids, out, lse)


def _rows_of(a: jax.Array, *, lo: int, hi: int, shape: tuple) -> jax.Array:
    """a[:, :, :, lo:hi] reshaped to `shape`: a query block's per-row statistics as rows."""
    return a[:, :, :, lo:hi].reshape(shape)


def _attention_bwd(block_size, res, g):
    q, k, v, segment_ids, out, lse = res
    f32 = jnp.float32
    dot = functools.partial(jnp.einsum, preferred_element_type=f32)
    b, kv, groups = q.shape[:3]
    # rowsum(dP * P) = rowsum(dO * O): the softmax backward's per-row term, [B, K, G, S]
    row = jnp.sum(_merge(g).astype(f32) * _merge(out).astype(f32), axis=-1).reshape(lse.shape)
    dq, dk, dv = [], jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
    for lo, hi in query_blocks(q.shape[3], block_size):
        qb, gb = _merge(q[:, :, :, lo:hi]), _merge(g[:, :, :, lo:hi].astype(v.dtype))
        t = functools.partial(_rows_of, lo=lo, hi=hi, shape=(b, kv, 1, -1))  # [B, K, G, n] rows
        bias_t = _block_bias_t(segment_ids, lo, hi, groups)
        pt = jnp.exp(dot("bktd,bkxd->bktx", k[:, :, :hi], qb) + bias_t - t(lse))  # P^T
        dst = pt * (dot("bktd,bkxd->bktx", v[:, :, :hi], gb) - t(row))  # dS^T [B, K, hi, G*n]
        dv = dv.at[:, :, :hi].add(dot("bktx,bkxd->bktd", pt.astype(v.dtype), gb))
        dst = dst.astype(q.dtype)
        dk = dk.at[:, :, :hi].add(dot("bktx,bkxd->bktd", dst, qb))
        # dS itself for dQ: the barrier keeps XLA from folding the transpose back into a
        # transposed-operand dot, which XLA:CPU runs single-threaded
        ds = jax.lax.optimization_barrier(jnp.swapaxes(dst, -1, -2))
        dq.append(dot("bkxt,bktd->bkxd", ds, k[:, :, :hi]).reshape(b, kv, groups, hi - lo, -1))
    dq = dq[0] if len(dq) == 1 else jnp.concatenate(dq, axis=3)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


attention_core.defvjp(_attention_fwd, _attention_bwd)


def cudnn_takes(dtype, head_dim: int) -> str:
    """"" when jax's cuDNN flash attention takes q/k/v of this dtype and (common) head dim,
    else why not: it takes bfloat16/float16 and head dims <= 128 that are multiples of 8."""
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN attention takes bfloat16/float16, not {jnp.dtype(dtype).name}"
    if head_dim > 128 or head_dim % 8:
        return f"cuDNN attention takes head dims <= 128 (multiples of 8), not {head_dim}"
    return ""


def fused_attention(q, k, v, segment_ids, scale: float | None = None):
    """q [B, S, H, Dh], k [B, T, K, Dh], v [B, T, K, Dv] -> [B, S, H, Dv] via
    jax.nn.dot_product_attention: cuDNN flash attention on GPU for bfloat16/float16 (causal
    skips the upper triangle; the document mask rides along as a [B, 1, S, T] mask), XLA
    elsewhere and for what cuDNN does not take (cudnn_takes). scale:
    the softmax scale (default Dh^-0.5). The kernel takes one head dim for q, k and v, so a
    narrower v (MLA: Dv < Dn + R) is padded with zero columns, whose outputs are 0 and dropped."""
    # cuDNN on the mesh's GPUs (not the host's devices) where it takes the shapes; else XLA
    cudnn = mesh_platform() == "gpu" and not cudnn_takes(q.dtype, max(q.shape[-1], v.shape[-1]))
    impl = "cudnn" if cudnn else "xla"
    same_doc = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    dh, dv = q.shape[-1], v.shape[-1]
    if dv < dh:
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, dh - dv)])
    elif dv > dh:  # zero columns of q and k add 0 to every score
        pad = [(0, 0)] * 3 + [(0, dv - dh)]
        q, k, scale = jnp.pad(q, pad), jnp.pad(k, pad), dh ** -0.5 if scale is None else scale
    out = jax.nn.dot_product_attention(q, k, v, mask=same_doc, is_causal=True, scale=scale,
                                       implementation=impl)
    return out[..., :dv]


def resolve_implementation(implementation: str, dtype) -> str:
    """attention.implementation with auto resolved for q/k/v of `dtype` on the current mesh's
    devices (sharding.mesh_device): tokamax on NVIDIA GPUs where its Mosaic flash attention
    takes the dtype (bfloat16/float16; every head dim, MLA's 192/128 too), else einsum (query
    blocks: no S x S scores; the CPU's choice)."""
    if implementation != "auto":
        return implementation
    if tokamax_ops.nvidia_gpu() and jnp.dtype(dtype) in tokamax_ops.DTYPES:
        return "tokamax"
    return "einsum"
