"""All-reduces whose result is only sliced to the device's 1/n are priced as reduce-scatters
(maxmoe/plan/scatter.py), the others stay all-reduces.

Expected bytes from the programs' own shapes and the ring formulas (reduce-scatter (n-1)/n x
input, all-reduce 2(n-1)/n x input); tolerance: exact up to float rounding (rel 1e-9).
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from maxmoe.plan.collectives import collective_bytes

F32 = 4
ABC = P("a", "b", "c")
LOCAL = 4 * 8 * 16 * F32  # (8, 16, 32) over a 2x2x2 mesh: (4, 8, 16) per device


def _mesh():
    return jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Explicit,) * 3)


def _hlo(fn, mesh):
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=ABC, out_specs=ABC))
    x = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32, sharding=NamedSharding(mesh, ABC))
    return f.lower(x).compile().as_text()


def _own_half(y):
    """The device's half of dim 1 along "b" (what SPMD does after a gradient all-reduce)."""
    return jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index("b") * 4, 4, axis=1)


def _kinds(result):
    return {(axis, kind): v["ici"] + v["dcn"]
            for axis, kinds in result.by_axis.items() for kind, v in kinds.items()}


def test_psum_then_own_slice_is_priced_as_a_reduce_scatter():
    mesh = _mesh()
    text = _hlo(lambda x: _own_half(jax.lax.psum(x, "b")) * 2.0, mesh)
    assert " all-reduce(" in text and "reduce-scatter(" not in text  # XLA:CPU's form
    assert _kinds(collective_bytes(text, mesh, devices_per_host=8)) == {
        ("b", "reduce-scatter"): pytest.approx((2 - 1) / 2 * LOCAL, rel=1e-9)}


def test_psum_sliced_and_used_whole_stays_an_all_reduce():
    def fn(x):
        y = jax.lax.psum(x, "b")
        return _own_half(y) + jnp.sum(y)  # the sum needs the whole reduced array

    mesh = _mesh()
    assert _kinds(collective_bytes(_hlo(fn, mesh), mesh, devices_per_host=8)) == {
        ("b", "all-reduce"): pytest.approx(2 * (2 - 1) / 2 * LOCAL, rel=1e-9)}


LITERAL = """HloModule m

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%shard (p0: f32[64,128], p1: u32[]) -> f32[16,64] {
  %p0 = f32[64,128]{1,0} parameter(0)
  %p1 = u32[] parameter(1)
  %off = s32[] convert(%p1)
  %zero = s32[] constant(0)
  %ds = f32[64,16]{1,0} dynamic-slice(%p0, %zero, %off), dynamic_slice_sizes={64,16}
  ROOT %t = f32[16,64]{0,1} transpose(%ds), dimensions={1,0}
}

%to_bf16 (q: f32[64,128]) -> bf16[64,128] {
  %q = f32[64,128]{1,0} parameter(0)
  ROOT %cv = bf16[64,128]{1,0} convert(%q)
}

ENTRY %main (g: f32[64,128], h: f32[256], k: f32[64,128], w: f32[64,128], u: f32[64,128], v: f32[64,128]) -> (f32[16,64], f32[256], f32[1024], f32[64,32], bf16[8,128], bf16[64,128]) {
  %g = f32[64,128]{1,0} parameter(0)
  %h = f32[256]{0} parameter(1)
  %k = f32[64,128]{1,0} parameter(2)
  %w = f32[64,128]{1,0} parameter(3)
  %u = f32[64,128]{1,0} parameter(4)
  %v = f32[64,128]{1,0} parameter(5)
  %pid = u32[] partition-id()
  %ar = (f32[64,128]{1,0}, f32[256]{0}) all-reduce(%g, %h), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %g0 = f32[64,128]{1,0} get-tuple-element(%ar), index=0
  %g1 = f32[256]{0} get-tuple-element(%ar), index=1
  %f = f32[16,64]{0,1} fusion(%g0, %pid), kind=kLoop, calls=%shard
  %st = f32[64,128]{1,0} all-reduce-start(%k), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %dn = f32[64,128]{1,0} all-reduce-done(%st)
  %bc = f32[8192]{0} bitcast(%dn)
  %sl = f32[1024]{0} slice(%bc), slice={[0:1024]}
  %ar2 = f32[64,128]{1,0} all-reduce(%w), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %quarter = f32[64,32]{1,0} slice(%ar2), slice={[0:64], [0:32]}
  %ar3 = f32[64,128]{1,0} all-reduce(%u), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %c3 = bf16[64,128]{1,0} fusion(%ar3), kind=kLoop, calls=%to_bf16
  %ar4 = bf16[64,128]{1,0} all-reduce(%c3), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %eighth = bf16[8,128]{1,0} slice(%ar4), slice={[0:8], [0:128]}
  %ar5 = f32[64,128]{1,0} all-reduce(%v), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  %c5 = bf16[64,128]{1,0} fusion(%ar5), kind=kLoop, calls=%to_bf16
  ROOT %out = (f32[16,64]{0,1}, f32[256]{0}, f32[1024]{0}, f32[64,32]{1,0}, bf16[8,128]{1,0}, bf16[64,128]{1,0}) tuple(%f, %g1, %sl, %quarter, %eighth, %c5)
}
"""


def test_literal_tuples_async_fusion_results_chains_and_oversized_slices():
    # %ar: element 0 only reaches a 1/8 dynamic-slice inside a fusion (reduce-scatter),
    # element 1 is returned whole (all-reduce). %st/%dn: an async all-reduce kept to 1/8 by a
    # slice after a bitcast (reduce-scatter). %ar2: a slice
    # keeping 1/4 of 8 devices' reduction is more than one shard (all-reduce). %ar3: its
    # fusion's result (a bfloat16 copy) goes into %ar4, whose result is sliced to 1/8: both
    # are reduce-scatters (%ar4 of a bfloat16 buffer). %ar5: its fusion's result is returned
    # whole (all-reduce).
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    block = 64 * 128 * F32
    got = _kinds(collective_bytes(LITERAL, mesh, devices_per_host=8))
    assert got == {
        ("x", "reduce-scatter"): pytest.approx(7 / 8 * (3 * block + block / 2), rel=1e-9),
        ("x", "all-reduce"): pytest.approx(2 * 7 / 8 * (256 * F32 + 2 * block), rel=1e-9)}
