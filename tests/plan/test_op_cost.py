"""plan/op_cost.py: FLOPs of Mosaic GPU kernels from their shapes, HBM bytes of fusions.

Expected figures from the module docstring's formulas on the shapes written here (grouped GEMM
2 M K N; causal flash attention half of 2 B H S T (Dqk + Dv); a fused dynamic-slice reads its
slice, a fused in-place dynamic-update-slice writes its update). Exact up to float rounding."""

import pytest

from maxmoe.plan.hlo import parse_instruction, parse_module
from maxmoe.plan.op_cost import OpCost, kernel_flops


def test_mosaic_grouped_gemm_and_flash_attention_flops():
    rows, k, n, groups = 1024, 128, 256, 4
    gemm = parse_instruction(
        f"  %g = bf16[{rows},{n}]{{1,0}} custom-call(bf16[{rows},{k}] %x, bf16[{groups},{k},{n}] "
        '%w, s32[19] %s), custom_call_target="mosaic_gpu_v2", '
        'metadata={op_name="moe/grouped_matmul/ragged_dot_sm90/mpmd_map"}')
    assert kernel_flops(gemm, {}) == ("gemm", 2 * rows * k * n)
    # the weight gradient: [K, M] x [M, N] -> [G, K, N], still 2 M K N
    dw = parse_instruction(
        f"  %d = bf16[{groups},{k},{n}]{{2,1,0}} custom-call(s32[4] %a, s32[4] %b, "
        f"bf16[{k},{rows}] %xt, bf16[{rows},{n}] %dy), custom_call_target=\"mosaic_gpu_v2\", "
        'metadata={op_name="moe/grouped_matmul/ragged_contracting_dim_dot_sm90/mpmd_map"}')
    assert kernel_flops(dw, {}) == ("gemm", 2 * rows * k * n)
    b, s, h, hk, d, dv = 2, 128, 4, 2, 192, 128
    attn = parse_instruction(
        f"  %o = (bf16[{b},{s},{h},{dv}]{{3,2,1,0}}, f32[{b},{h},{s}]{{2,1,0}}) custom-call("
        f"bf16[{b},{s},{h},{d}] %q, bf16[{b},{s},{hk},{d}] %k, bf16[{b},{s},{hk},{dv}] %v), "
        'custom_call_target="mosaic_gpu_v2", '
        'metadata={op_name="jvp()/attention/flash_attention_sm90/mpmd_map"}')
    assert kernel_flops(attn, {}) == ("attention",
                                      pytest.approx(2 * b * h * s * s * (d + dv) / 2, rel=1e-12))
    other = parse_instruction('  %t = f32[8]{0} custom-call(f32[8] %z), custom_call_target="TopK"')
    assert kernel_flops(other, {}) is None


def test_fused_slices_read_and_in_place_updates_write_only_their_part():
    layers, width = 8, 1024
    text = f"""HloModule m, is_scheduled=true

%slice_body (p0: f32[{layers},{width}], p1: s32[]) -> f32[1,{width}] {{
  %p0 = f32[{layers},{width}]{{1,0}} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,{width}]{{1,0}} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={{1,{width}}}
}}

%update_body (q0: f32[{layers},{width}], q1: f32[1,{width}], q2: s32[]) -> f32[{layers},{width}] {{
  %q0 = f32[{layers},{width}]{{1,0}} parameter(0)
  %q1 = f32[1,{width}]{{1,0}} parameter(1)
  %q2 = s32[] parameter(2)
  %z2 = s32[] constant(0)
  ROOT %dus = f32[{layers},{width}]{{1,0}} dynamic-update-slice(%q0, %q1, %q2, %z2)
}}

ENTRY %main (w: f32[{layers},{width}], i: s32[]) -> f32[{layers},{width}] {{
  %w = f32[{layers},{width}]{{1,0}} parameter(0)
  %i = s32[] parameter(1)
  %f = f32[1,{width}]{{1,0}} fusion(%w, %i), kind=kLoop, calls=%slice_body
  ROOT %u = f32[{layers},{width}]{{1,0}} fusion(%w, %f, %i), kind=kLoop, calls=%update_body
}}
"""
    comps, entry = parse_module(text)
    cost = OpCost(comps)
    fused = {i.name: i for i in comps[entry]}
    row, index = width * 4, 4
    assert cost.hbm_bytes(fused["f"]) == row + index + row  # read a row (and i), write a row
    assert cost.hbm_bytes(fused["u"]) == row + index + row  # read the update (and i), write it
    assert cost.flops(fused["f"]) == (0.0, 0.0) and not cost.uncounted
