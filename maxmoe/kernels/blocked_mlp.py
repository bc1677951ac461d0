"""The blocked grouped expert MLP (`moe.grouped_matmul: blocked`): SwiGLU over per-expert row
blocks (grouped_matmul.blocked_rows sorts the assignments into them), a loop over the blocks in
use with its own backward, so XLA:CPU runs no dense `ragged_dot` expansion. FP8 (kernels/fp8.py)
quantises inside the loop; tensorwise weights the expert output (its one scale covers all of h).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxmoe.kernels.fp8 import (
    NO_AXES,
    AmaxAxes,
    expert_scales,
    fp8_matmul,
    scale_of,
    tensorwise_matmul,
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def block_expert_mlp(x, token, row_weight, w_gate, w_up, w_down, bounds, fp8="none",
                     amax=NO_AXES):
    """Dispatch, SwiGLU expert MLP and weighted combine over row blocks grouped by expert:
    y[t] = sum over slots j with token[j] = t of row_weight[j] * expert_e(x[t]) for every
    slot of blocks bounds[e]:bounds[e+1] (expert e), expert_e(v) = (silu(v @ Wg[e]) *
    (v @ Wu[e])) @ Wd[e]. Blocks from bounds[-1] on are never visited.
    x [..., D], read as its T flattened rows (the caller's [B, S, D] array itself, so that the
    layer scan does not stack a reshaped copy of the router's input a second time as this
    kernel's residual); token [N, bs] int (an empty slot: any token with row_weight 0); row_weight
    [N, bs] float32; w_gate, w_up [E, D, F]; w_down [E, F, D]; bounds [E + 1] int,
    non-decreasing, bounds[0] = 0. Returns y [T, D] float32 (the K contributions per token
    summed in float32).

    A loop over experts around a loop over their blocks (GROUP blocks a step while that many
    remain, then one): each step gathers its blocks' token rows, runs the 2-D matmuls (gate | up
    joined) and scatter-adds the weighted output rows, so no [N * bs, D] copy of the inputs or
    outputs is made; weight gradients are added in place into float32 [E, ...] accumulators.
    The backward recomputes each block's gate/up matmul (tensorwise: the down one too), so the
    kernel's residuals are its inputs and the layer scan stacks none of its activations. The
    router weight multiplies each slot's hidden (tensorwise: its output, so that one scale
    covers all of h, as in the ragged kernel and at the all-to-all senders); its gradient is
    rowsum((g @ Wd^T) * h) (tensorwise: rowsum(g * output), `_Expert.backward_rows`). Why
    this shape and not
    ragged_dot or a batched matmul: docs/performance/planning.md, Grouped matmul.
    fp8 (precision.fp8): tensorwise / blockwise run every matmul of a step on E4M3 operands
    (kernels/fp8.py; gate and up quantised apart; the weight gradients' token tiles are the
    step's rows, 128 at a time, empty slots zeroed so they count in no tile's amax).
    Tensorwise takes one scale per operand tensor over every routed row of every expert
    (`Scales`, a first pass over the blocks for the hidden, and in the backward for d[gate |
    up]), reduced over the mesh axes of `amax` (kernels/fp8.AmaxAxes), and one per expert
    weight; the forward's scales are residuals, so the backward quantises h as it did.
    """
    return _block_expert_mlp_fwd(x, token, row_weight, w_gate, w_up, w_down, bounds, fp8,
                                 amax)[0]


class Scales(NamedTuple):
    """The blocked kernel's tensorwise scales (float32), each over the whole tensor: x (the
    routed rows), h (the hidden, the down projection's input); in the backward (1 in the
    forward) g and dgu (the down projection's output cotangent, router weight times the
    output's, and d[gate | up]); wg, wu, wd [E], one per expert weight."""
    x: jax.Array
    h: jax.Array
    g: jax.Array
    dgu: jax.Array
    wg: jax.Array
    wu: jax.Array
    wd: jax.Array


class _Expert:
    """Expert e's matmuls in the kernel's precision: fp8 none (plain dots), blockwise
    (fp8_matmul's tiles) or tensorwise (with the given Scales)."""

    def __init__(self, e, w_gate, w_up, w_down, fp8: str, sc: Scales | None):
        self.wgu = jnp.concatenate([w_gate[e], w_up[e]], axis=1)
        self.wd, self.f, self.fp8, self.sc, self.e = w_down[e], w_down.shape[1], fp8, sc, e

    def _mm(self, a, sa, b, sb, b_tile: int = 128):
        """a @ b with float32 accumulation; sa, sb: names of the operands' Scales fields."""
        if self.fp8 == "none":
            return jnp.dot(a, b, preferred_element_type=jnp.float32)
        if self.fp8 == "tensorwise":
            sa, sb = getattr(self.sc, sa), getattr(self.sc, sb)
            return tensorwise_matmul(a, sa if sa.ndim == 0 else sa[self.e],
                                     b, sb if sb.ndim == 0 else sb[self.e])
        return fp8_matmul(a, b, self.fp8, b_tile)

    def gate_up(self, v):
        """v @ [Wg | Wu] in v's dtype; under fp8 the two weights are quantised apart."""
        f = self.f
        if self.fp8 == "none":
            return v @ self.wgu
        return jnp.concatenate([self._mm(v, "x", self.wgu[:, :f], "wg"),
                                self._mm(v, "x", self.wgu[:, f:], "wu")], 1).astype(v.dtype)

    def down(self, h):
        return self._mm(h, "h", self.wd, "wd")

    def backward_rows(self, xi, g, w):
        """One step's rows back to d[gate | up], from rows xi, output cotangents g (xi's
        dtype) and router weights w [rows, 1]: (h float32, the down weight gradient's operands
        (lhs rows, rhs rows), d row weight [rows], dgu in xi's dtype). fp8 none / blockwise:
        g @ Wd^T once gives dh / w and the row weight's gradient rowsum(g @ Wd^T * h)
        (blockwise's 1x128 row tiles take w g and g alike). Tensorwise quantises the down
        projection's output cotangent w g with one scale (as the ragged kernel's autodiff and
        the all-to-all senders do) and takes the row weight's gradient as rowsum(g * output)
        with the output recomputed (the identity does not hold for quantised operands); its
        down operand is the forward's own h, in xi's dtype, under the forward's scale."""
        f = self.f
        gu_x = self.gate_up(xi)
        gu = gu_x.astype(jnp.float32)
        gate, up = gu[:, :f], gu[:, f:]
        sig = jax.nn.sigmoid(gate)
        act = gate * sig  # silu
        h = act * up
        if self.fp8 != "tensorwise":
            dhw = self._mm(g, "g", self.wd.T, "wd")
            dh, drw, down = dhw * w, jnp.sum(dhw * h, axis=1), ((h * w).astype(xi.dtype), g)
        else:
            hx = jax.nn.silu(gu_x[:, :f]) * gu_x[:, f:]  # the forward's expression
            gw = (g * w).astype(xi.dtype)
            dh = self._mm(gw, "g", self.wd.T, "wd")
            drw, down = jnp.sum(g.astype(jnp.float32) * self.down(hx), axis=1), (hx, gw)
        dgate = dh * up * (sig * (1 + gate * (1 - sig)))  # d silu = sig (1 + x (1 - sig))
        return h, down, drw, jnp.concatenate([dgate, dh * act], axis=1).astype(xi.dtype)

    def input_grad(self, dgu):
        f = self.f
        if self.fp8 == "none":
            return self._mm(dgu, "dgu", self.wgu.T, "wg")
        return (self._mm(dgu[:, :f], "dgu", self.wgu[:, :f].T, "wg")
                + self._mm(dgu[:, f:], "dgu", self.wgu[:, f:].T, "wu"))

    def weight_grads(self, xi, dgu, down):
        """(d[Wg | Wu], d Wd) of one step's rows (down: backward_rows' operands); fp8: 128x1
        tiles along the rows."""
        return self._mm(xi.T, "x", dgu, "dgu", 1), self._mm(down[0].T, "h", down[1], "g", 1)


def _forward_scales(x, token, row_weight, w_gate, w_up, w_down, bounds,
                    amax: AmaxAxes) -> Scales:
    """block_expert_mlp's tensorwise forward Scales: x over the routed rows (some slot in use,
    row weight != 0), one per expert weight, h over every slot in use (a pass over the
    blocks), each amax reduced over `amax`'s axes; g and dgu 1."""
    x = x.reshape(-1, x.shape[-1])
    routed = _routed_weight(token, row_weight, x.shape[0]) > 0
    one = jnp.ones((), jnp.float32)
    sc = Scales(scale_of(jnp.max(jnp.where(routed, _row_max(x), 0.0)), amax.rows), one, one, one,
                *(expert_scales(w, amax.weights) for w in (w_gate, w_up, w_down)))

    def hidden_max(ex, tok, w):
        gu = ex.gate_up(x[tok])
        return jnp.max(jnp.where(w[:, 0] != 0, _row_max(jax.nn.silu(gu[:, :ex.f]) * gu[:, ex.f:]),
                                 0.0))
    h_max = _blocks_max(hidden_max, sc, token, row_weight, w_gate, w_up, w_down, bounds)
    return sc._replace(h=scale_of(h_max, amax.rows))


def _backward_scales(fwd: Scales, gy, x, token, row_weight, w_gate, w_up, w_down, bounds,
                     amax: AmaxAxes) -> Scales:
    """fwd (the forward's Scales) with the backward's: g, of the slots' w g (rounding is
    monotone, so the amax is max w times max |g| per token), and dgu (a pass over the
    blocks), each reduced over `amax`'s axes. gy [T, D]: the output's cotangent."""
    x = x.reshape(-1, x.shape[-1])
    wmax = _routed_weight(token, row_weight, x.shape[0])
    g_max = jnp.max(wmax * _row_max(gy.astype(x.dtype))).astype(x.dtype)
    sc = fwd._replace(g=scale_of(g_max.astype(jnp.float32), amax.rows))

    def dgu_max(ex, tok, w):
        return jnp.max(_row_max(ex.backward_rows(x[tok], gy[tok].astype(x.dtype), w)[3]))
    return sc._replace(dgu=scale_of(
        _blocks_max(dgu_max, sc, token, row_weight, w_gate, w_up, w_down, bounds), amax.rows))


def _routed_weight(token, row_weight, t: int):
    """[T] float32: each token's largest router weight over the slots (0: in none in use)."""
    return jnp.zeros(t, jnp.float32).at[token.reshape(-1)].max(
        jnp.abs(row_weight.reshape(-1)).astype(jnp.float32))


def _row_max(a):
    """Per row, the largest |element|, float32."""
    return jnp.max(jnp.abs(a.astype(jnp.float32)), axis=1)


def _blocks_max(block_max, sc: Scales, token, row_weight, w_gate, w_up, w_down, bounds):
    """The max over every block step of every expert of block_max(expert, token rows, router
    weights [rows, 1]) (float32 scalar), the experts' matmuls tensorwise with scales sc."""
    def expert(e, acc):
        ex = _Expert(e, w_gate, w_up, w_down, "tensorwise", sc)

        def step(i, m, acc):
            return jnp.maximum(acc, block_max(ex, _rows(token, i, m),
                                              _rows(row_weight, i, m)[:, None]))
        return _over_blocks(bounds[e], bounds[e + 1], step, acc)
    return jax.lax.fori_loop(0, w_down.shape[0], expert, jnp.zeros((), jnp.float32))


def _block_expert_mlp_fwd(x, token, row_weight, w_gate, w_up, w_down, bounds, fp8="none",
                          amax=NO_AXES):
    x, token, row_weight, w_gate, w_up, w_down, bounds = (
        jnp.asarray(a) for a in (x, token, row_weight, w_gate, w_up, w_down, bounds))
    sc = (_forward_scales(x, token, row_weight, w_gate, w_up, w_down, bounds, amax)
          if fp8 == "tensorwise" else None)
    res = (x, token, row_weight, w_gate, w_up, w_down, bounds, sc)
    x = x.reshape(-1, x.shape[-1])

    def expert(e, carry):
        ex = _Expert(e, w_gate, w_up, w_down, fp8, sc)

        def block(i, m, y):
            tok, w = _rows(token, i, m), _rows(row_weight, i, m)[:, None]
            gu = ex.gate_up(x[tok])
            h = jax.nn.silu(gu[:, :ex.f]) * gu[:, ex.f:]
            if fp8 == "tensorwise":  # one scale for all of h: the router weight goes on the
                # output, as in the ragged kernel and at the all-to-all senders
                return y.at[tok].add(ex.down(h.astype(x.dtype)) * w)
            return y.at[tok].add(ex.down((h * w).astype(x.dtype)))
        return _over_blocks(bounds[e], bounds[e + 1], block, carry)
    y = jax.lax.fori_loop(0, w_down.shape[0], expert,
                          jnp.zeros((x.shape[0], w_down.shape[2]), jnp.float32))
    return y, res


def block_expert_mlp_accumulate(acc, gy, x, token, row_weight, w_gate, w_up, w_down, bounds,
                                fp8="none", amax=NO_AXES, scales: Scales | None = None):
    """block_expert_mlp's backward into float32 accumulators acc = (dx [T, D], d row_weight
    [N, bs], d w_gate, d w_up, d w_down) (their shapes as the inputs'): returns acc with the
    gradients added (d row_weight: set for the blocks in use, the rest kept). gy [T, D]: the
    output's cotangent. A caller that runs the kernel several times on the same weights
    (parallel/all_to_all.py's rounds) sums the weight gradients here, in place, instead of in
    a second weight-sized buffer. scales: the forward's tensorwise Scales (None: taken
    again here, as the forward takes them)."""
    x, gy = x.reshape(-1, x.shape[-1]), jnp.asarray(gy)
    sc = None
    if fp8 == "tensorwise":
        ws = (token, row_weight, w_gate, w_up, w_down, bounds)
        fwd = scales if scales is not None else _forward_scales(x, *ws, amax)
        sc = _backward_scales(fwd, gy, x, *ws, amax)

    def expert(e, carry):
        ex = _Expert(e, w_gate, w_up, w_down, fp8, sc)

        def block(i, m, carry):
            dx, drw, dwg, dwu, dwd = carry
            tok, w = _rows(token, i, m), _rows(row_weight, i, m)[:, None].astype(jnp.float32)
            g, xi = gy[tok].astype(x.dtype), x[tok]
            _, down, drw_rows, dgu = ex.backward_rows(xi, g, w)
            drw = jax.lax.dynamic_update_slice_in_dim(drw, drw_rows.reshape(m, -1), i, 0)
            dx = dx.at[tok].add(ex.input_grad(dgu))
            # weight gradients sum over many blocks: added in place into float32 [E, ...]
            # accumulators whatever the dtype (no per-expert zero fill, add and copy-out)
            if fp8 != "none":  # empty slots (weight 0: dgu rows 0) out of every amax
                xi, down = (jnp.where(w != 0, xi, 0),
                            tuple(jnp.where(w != 0, a, 0) for a in down))
            gwgu, gwd = ex.weight_grads(xi, dgu, down)
            return (dx, drw, dwg.at[e].add(gwgu[:, :ex.f]), dwu.at[e].add(gwgu[:, ex.f:]),
                    dwd.at[e].add(gwd))
        return _over_blocks(bounds[e], bounds[e + 1], block, carry)
    return jax.lax.fori_loop(0, w_down.shape[0], expert, tuple(acc))


def _block_expert_mlp_bwd(fp8, amax, res, gy):
    *res, sc = res
    x, token, row_weight, w_gate, w_up, w_down, bounds = res
    zeros = tuple(jnp.zeros((math.prod(x.shape[:-1]), x.shape[-1]) if a is x else a.shape,
                            jnp.float32) for a in (x, row_weight, w_gate, w_up, w_down))
    dx, drw, dwg, dwu, dwd = block_expert_mlp_accumulate(zeros, gy, *res, fp8, amax, sc)
    return (dx.astype(x.dtype).reshape(x.shape), None, drw.astype(row_weight.dtype),
            dwg.astype(w_gate.dtype), dwu.astype(w_up.dtype), dwd.astype(w_down.dtype), None)


block_expert_mlp.defvjp(_block_expert_mlp_fwd, _block_expert_mlp_bwd)

# blocks per loop step: 4 blocks of 128 rows make 512-row matmuls, which XLA:CPU runs on both
# cores, and a quarter of the per-op overhead (docs/performance/planning.md, Grouped matmul)
GROUP = 4


def _rows(a, i, m):
    """Blocks i:i+m of a [N, bs, ...] array as one [m * bs, ...] array."""
    part = jax.lax.dynamic_slice_in_dim(a, i, m)
    return part.reshape(-1, *a.shape[2:])


def _over_blocks(lo, hi, body, carry):
    """body(i, m, carry) over blocks lo:hi, m (static) blocks at a time: GROUP while that many
    remain, then one by one."""
    n = (hi - lo) // GROUP
    carry = jax.lax.fori_loop(0, n, lambda j, c: body(lo + j * GROUP, GROUP, c), carry)
    return jax.lax.fori_loop(lo + n * GROUP, hi, lambda i, c: body(i, 1, c), carry)
