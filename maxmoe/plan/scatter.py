"""All-reduces that act as reduce-scatters: the parts of an all-reduce's result that every use
only slices down to 1/n (n the group size), read from the partitioned HLO.

XLA:CPU never emits reduce-scatter: it lowers a sharded gradient's reduction to an all-reduce
followed by a dynamic-slice of the device's shard (often fused into the consumer), where
XLA:GPU emits a reduce-scatter. A ring all-reduce moves 2(n-1)/n x its input, a reduce-scatter
(n-1)/n: pricing these as all-reduces overstates the gradient traffic up to 2x, so
`maxmoe.plan.collectives` prices the parts found here as reduce-scatters.

A part qualifies when it has at least one use, is no computation's result, and every use,
followed through element-preserving ops (bitcast, copy, convert, reshape, transpose, an async
collective's -done, get-tuple-element of a tuple all-reduce), elementwise ops whose result is
as large (a slice of a + b needs only that slice of a) and into fusions (to the parameter the
value is passed as), is a slice or dynamic-slice of the value (its first
operand) keeping at most 1/n of its elements. Slice offsets are not checked: SPMD
partitioning slices each device's own shard (offsets from partition-id).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

_PASS_THROUGH = ("bitcast", "copy", "convert", "reshape", "transpose")
# elementwise: a slice of f(a, b) needs only the same slice of a (result as large as a)
_ELEMENTWISE = ("add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
                "select", "sqrt", "rsqrt", "exponential", "clamp")
_SLICES = ("slice", "dynamic-slice")
_DIMS = re.compile(r"\b[a-z][a-z0-9]*\[([<=\d,]*)\]")
_INDEX = re.compile(r"(?:^|[\s,])index=(\d+)")
_PARAM = re.compile(r"^\s*(\d+)\s*$")


class _Instr(Protocol):  # maxmoe.plan.collectives.Instr
    name: str
    type: str
    opcode: str
    operands: list[str]
    attrs: str
    root: bool


Uses = dict[str, list[tuple[_Instr, int]]]  # value name -> [(user, operand position)]


def elements(shape: str) -> int:
    """Elements of one array shape text (`f32[64,128]{1,0}` -> 8192; a scalar -> 1)."""
    m = _DIMS.search(re.sub(r"/\*.*?\*/", "", shape))
    if not m:
        raise ValueError(f"not an array shape: {shape!r}")
    total = 1
    for d in m.group(1).split(","):
        if d:
            total *= int(d.replace("<=", ""))
    return total


def operand_name(operand: str) -> str:
    """`%x` or `f32[4] %x` -> `x`."""
    return operand.rsplit(None, 1)[-1].lstrip("%")


def use_index(comps: Mapping[str, Sequence[_Instr]]) -> Callable[[str], Uses]:
    """uses(computation) -> {value name: [(user instruction, operand position)]}, cached."""

    @functools.cache
    def uses(comp: str) -> Uses:
        out: Uses = {}
        for ins in comps[comp]:
            for pos, op in enumerate(ins.operands):
                out.setdefault(operand_name(op), []).append((ins, pos))
        return out

    return uses


def _fusion_parameter(comps: Mapping[str, Sequence[_Instr]], fusion: _Instr,
                      pos: int) -> tuple[str, str] | None:
    """(fused computation, name of its parameter(pos)) for a fusion's operand pos."""
    m = re.search(r"(?:^|[\s,])calls=%?([\w.\-]+)", fusion.attrs)
    if not m or m.group(1) not in comps:
        return None
    for ins in comps[m.group(1)]:
        if ins.opcode == "parameter" and _PARAM.match(ins.operands[0] if ins.operands else "") \
                and int(ins.operands[0]) == pos:
            return m.group(1), ins.name
    return None


def slice_only(comps: Mapping[str, Sequence[_Instr]], uses: Callable[[str], Uses], comp: str,
               value: _Instr, size: int, n: int, depth: int = 0) -> bool:
    """Whether every use of `value` (in computation `comp`) keeps at most size / n of its
    `size` elements by slicing (module docstring); False for an unused or returned value."""
    found = uses(comp).get(value.name, [])
    if not found or value.root or depth > 16:
        return False
    for user, pos in found:
        if user.opcode in _SLICES:
            if pos != 0 or elements(user.type) * n > size:
                return False
        elif user.opcode in _PASS_THROUGH or user.opcode.endswith("-done") or (
                user.opcode in _ELEMENTWISE and elements(user.type) == size):
            if not slice_only(comps, uses, comp, user, size, n, depth + 1):
                return False
        elif user.opcode == "fusion":
            target = _fusion_parameter(comps, user, pos)
            if target is None:
                return False
            fused, param = target
            inner = next(i for i in comps[fused] if i.name == param)
            if not slice_only(comps, uses, fused, inner, size, n, depth + 1):
                return False
        else:
            return False
    return True


def _tuple_parts(type_: str) -> list[str]:
    """Element shape texts of a tuple shape `(a, b)`; [type_] for an array."""
    text = re.sub(r"/\*.*?\*/", "", type_).strip()
    if not text.startswith("("):
        return [text]
    parts, depth, cur = [], 0, ""
    for ch in text[1:-1]:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + ([cur.strip()] if cur.strip() else [])


def scattered_parts(comps: Mapping[str, Sequence[_Instr]], uses: Callable[[str], Uses],
                    comp: str, ins: _Instr, n: int) -> list[str]:
    """Shape texts of the parts of all-reduce `ins` (in `comp`, group size n) whose result is
    only sliced to 1/n: the whole result for an array, tuple elements reached through
    get-tuple-element (through an async -done first) for a tuple."""
    parts = _tuple_parts(ins.type)
    if len(parts) == 1 and not ins.type.lstrip().startswith("("):
        return parts if slice_only(comps, uses, comp, ins, elements(parts[0]), n) else []
    holder = ins
    done = [u for u, _ in uses(comp).get(ins.name, []) if u.opcode.endswith("-done")]
    if len(done) == 1 and len(uses(comp)[ins.name]) == 1:
        holder = done[0]
        parts = _tuple_parts(holder.type)
        if len(parts) == 1 and not holder.type.lstrip().startswith("("):
            return parts if slice_only(comps, uses, comp, holder, elements(parts[0]), n) else []
    by_index: dict[int, list[_Instr]] = {}
    for user, _ in uses(comp).get(holder.name, []):
        m = _INDEX.search(user.attrs)
        if user.opcode != "get-tuple-element" or not m:
            return []  # the tuple itself is used: nothing can be said per element
        by_index.setdefault(int(m.group(1)), []).append(user)
    return [parts[i] for i, gtes in sorted(by_index.items())
            if all(slice_only(comps, uses, comp, g, elements(parts[i]), n) for g in gtes)]
