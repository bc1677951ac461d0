"""The roofline cost of one compute op of optimised XLA:GPU HLO: its GEMM and attention FLOPs and
the bytes it moves in HBM, for plan/overlap.py, which prices a compute op at max(GEMM FLOPs /
GEMM rate + attention FLOPs / attention rate, HBM bytes / HBM bandwidth).

FLOPs: dots and cuBLAS GEMMs as compiled_flops.py counts them, a fusion's (or async wrapper's) by
its body. Tokamax's Mosaic GPU kernels are custom calls whose FLOPs the HLO does not give; they
are estimated from their operand shapes by the op_name scope the kernels carry:
- grouped GEMM (op_name `ragged...dot`, forward and both gradients): 2 x the elements of its
  first 2-D float operand x the result's last dim (every row meets one group: 2 M K N);
- flash attention (op_name `attention`): q [B, S, H, Dqk], k [B, T, Hk, Dqk], v [B, T, Hk, Dv];
  an S x T matmul costs 2 B H S T D, halved for the causal mask (maxmoe's attention is causal,
  metrics.flops counts it so); forward QK and PV (Dqk + Dv); a backward kernel returning one
  gradient (dq) 2 Dqk + Dv, two (dk, dv) 2 Dqk + 2 Dv, three 3 Dqk + 2 Dv.
Other custom calls get no FLOPs (their bytes are a lower bound of their time): `uncounted` names
them. HBM bytes: operands and result, except that a fused dynamic-slice, slice or gather reads
only what it takes, and a fused in-place dynamic-update-slice neither reads its buffer nor
writes more than its update.
"""

from __future__ import annotations

import math
import re

from maxmoe.plan.compiled_flops import instruction_flops
from maxmoe.plan.hlo import (
    Instr,
    callees,
    operand_name,
    parameter_number,
    shape_bytes,
    tuple_parts,
)

_SLICES = ("dynamic-slice", "slice", "gather")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_DIMS = re.compile(r"([a-z][a-z0-9]*)\[([\d,]*)\]")


def _dims(type_: str) -> tuple[str, list[int]]:
    """(element type, dims) of the first array in a shape text; ("", []) for none."""
    m = _DIMS.search(type_)
    return (m.group(1), [int(d) for d in m.group(2).split(",") if d]) if m else ("", [])


def _attention_flops(shapes: list[tuple[str, list[int]]], results: int, backward: bool) -> float:
    """Module docstring's flash attention estimate from q, k, v shapes."""
    (_, q), (_, k), (_, v) = shapes[:3]
    b, s, h, dqk = q
    per = 2.0 * b * h * s * k[1] / 2  # per unit of head dim, causal half
    if not backward:
        return per * (dqk + v[-1])
    return per * {1: 2 * dqk + v[-1], 2: 2 * dqk + 2 * v[-1]}.get(results, 3 * dqk + 2 * v[-1])


def kernel_flops(ins: Instr, types: dict[str, str]) -> tuple[str, float] | None:
    """(class, FLOPs) of one Mosaic GPU grouped GEMM ("gemm") or flash attention ("attention")
    custom call, estimated from its operand shapes (module docstring); None for any other."""
    m = _OP_NAME.search(ins.attrs)
    name = m.group(1) if m else ""
    shapes = [_dims(_operand_type(op, types)) for op in ins.operands]
    out = [_dims(p) for p in tuple_parts(ins.type)]
    if re.search(r"ragged\w*dot", name):
        lhs = next((d for t, d in shapes if len(d) == 2 and t[0] in "fb"), None)
        return None if lhs is None else ("gemm", 2.0 * math.prod(lhs) * out[0][1][-1])
    if "attention" in name and len(shapes) >= 3 and all(len(d) == 4 for _, d in shapes[:3]):
        same = sum(1 for t, _ in out if t == shapes[0][0])
        return "attention", _attention_flops(shapes, same, "transpose(" in name)
    return None


def _operand_type(operand: str, types: dict[str, str]) -> str:
    """The shape text of an operand as printed (`f32[4] %x`) or as its instruction's result."""
    parts = operand.rsplit(None, 1)
    return parts[0] if len(parts) == 2 else types[operand_name(operand)]


class OpCost:
    """FLOPs and HBM bytes of the instructions of one parsed module (module docstring)."""

    def __init__(self, comps: dict[str, list[Instr]]):
        self.comps = comps
        self.types = {i.name: i.type for body in comps.values() for i in body}
        self.uncounted: dict[str, str] = {}  # custom-call instruction -> target, no FLOPs known
        self._flops: dict[str, tuple[float, float]] = {}

    def flops(self, ins: Instr) -> tuple[float, float]:
        """(GEMM FLOPs, attention FLOPs) of one instruction, fusions' bodies included; dots,
        cuBLAS GEMMs and the grouped GEMM are GEMM FLOPs."""
        if ins.opcode in ("fusion", "fusion-start", "async-start"):
            subs = [self.body_flops(c) for c in callees(ins) if c in self.comps]
            return sum(g for g, _ in subs), sum(a for _, a in subs)
        found = instruction_flops(ins, self.types)
        if found is not None:
            return found, 0.0
        if ins.opcode != "custom-call":
            return 0.0, 0.0
        kernel = kernel_flops(ins, self.types)
        if kernel is None:
            m = _TARGET.search(ins.attrs)
            self.uncounted[ins.name] = m.group(1) if m else "?"
            return 0.0, 0.0
        return (0.0, kernel[1]) if kernel[0] == "attention" else (kernel[1], 0.0)

    def body_flops(self, comp: str) -> tuple[float, float]:
        """flops() summed over a fused computation (memoised)."""
        if comp not in self._flops:
            parts = [self.flops(i) for i in self.comps[comp]]
            self._flops[comp] = (sum(g for g, _ in parts), sum(a for _, a in parts))
        return self._flops[comp]

    def hbm_bytes(self, ins: Instr) -> float:
        """Bytes an op reads and writes in HBM (module docstring)."""
        fused = [c for c in callees(ins) if c in self.comps]
        result = tuple_parts(ins.type)[1] if ins.opcode == "fusion-start" else ins.type
        if ins.opcode in ("fusion", "fusion-start") and fused:
            return self._fusion_bytes(ins, self.comps[fused[0]], result)
        if ins.opcode == "dynamic-slice":
            return 2 * shape_bytes(result)
        if ins.opcode == "dynamic-update-slice":
            return 2 * shape_bytes(_operand_type(ins.operands[1], self.types))
        return shape_bytes(result) + sum(shape_bytes(_operand_type(o, self.types))
                                         for o in ins.operands)

    def _fusion_bytes(self, ins: Instr, body: list[Instr], result: str) -> float:
        """HBM bytes of fusion `ins` whose fused computation is `body` (module docstring)."""
        by_name = {i.name: i for i in body}
        users: dict[str, list[tuple[int, Instr]]] = {}
        for i in body:
            for k, op in enumerate(i.operands):
                users.setdefault(operand_name(op), []).append((k, i))
        total = 0.0
        for i in body:
            n = parameter_number(i)
            if n is None or n >= len(ins.operands):
                continue
            uses = users.get(i.name, [])
            if uses and all(u.opcode in _SLICES and k == 0 for k, u in uses):
                total += sum(shape_bytes(u.type) for _, u in uses)
            elif not (uses and all(u.opcode == "dynamic-update-slice" and k == 0
                                   for k, u in uses)):  # in place: not read
                total += shape_bytes(_operand_type(ins.operands[n], self.types))
        root = next((i for i in body if i.root), None)
        parts = ([by_name.get(operand_name(o)) for o in root.operands]
                 if root is not None and root.opcode == "tuple" else [root])
        if any(p is None for p in parts):
            return total + shape_bytes(result)
        for p in parts:
            update = p.opcode == "dynamic-update-slice"
            total += shape_bytes(self.types[operand_name(p.operands[1])] if update else p.type)
        return total
