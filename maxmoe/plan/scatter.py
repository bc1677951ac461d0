"""All-reduces that act as reduce-scatters: the parts of an all-reduce's result that every use
only slices down to 1/n (n the group size), read from the partitioned HLO.

XLA:CPU never emits reduce-scatter: it lowers a sharded gradient's reduction to an all-reduce
followed by a dynamic-slice of the device's shard (often fused into the consumer), where
XLA:GPU emits a reduce-scatter. A ring all-reduce moves 2(n-1)/n x its input, a reduce-scatter
(n-1)/n: pricing these as all-reduces overstates the gradient traffic up to 2x, so
`maxmoe.plan.collectives` prices the parts found here as reduce-scatters.

A part qualifies when every use, followed through element-preserving ops (bitcast, copy,
convert, reshape, transpose, an async collective's -done, get-tuple-element of a tuple
all-reduce), elementwise ops whose result is as large (a slice of a + b needs only that slice
of a), into fusions (to the parameter the value is passed as, and out again where it reaches
the fusion's result) and through a further all-reduce (XLA:CPU reduces a gradient stored over
two axes with one all-reduce per axis), ends in a slice or dynamic-slice of the value (its
first operand) keeping at most 1/n of its elements; an unused or returned value does not.
Slice offsets are not checked: SPMD partitioning slices each device's own shard (offsets from
partition-id). The second all-reduce of such a chain is priced on the whole buffer, where a
GPU reduce-scatters the first one's 1/n piece: an overcount that remains.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

from maxmoe.plan.hlo import (
    Instr,
    attr,
    elements,
    operand_name,
    parameter_number,
    tuple_parts,
)

_PASS_THROUGH = ("bitcast", "copy", "convert", "reshape", "transpose")
# elementwise: a slice of f(a, b) needs only the same slice of a (result as large as a)
_ELEMENTWISE = ("add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs",
                "select", "sqrt", "rsqrt", "exponential", "clamp")
_SLICES = ("slice", "dynamic-slice")


Uses = dict[str, list[tuple[Instr, int]]]  # value name -> [(user, operand position)]


def use_index(comps: Mapping[str, Sequence[Instr]]) -> Callable[[str], Uses]:
    """uses(computation) -> {value name: [(user instruction, operand position)]}, cached."""

    @functools.cache
    def uses(comp: str) -> Uses:
        out: Uses = {}
        for ins in comps[comp]:
            for pos, op in enumerate(ins.operands):
                out.setdefault(operand_name(op), []).append((ins, pos))
        return out

    return uses


def _fusion_parameter(comps: Mapping[str, Sequence[Instr]], fusion: Instr,
                      pos: int) -> tuple[str, str] | None:
    """(fused computation, name of its parameter(pos)) for a fusion's operand pos."""
    called = (attr(fusion.attrs, "calls") or "").lstrip("%")
    if called not in comps:
        return None
    for ins in comps[called]:
        if parameter_number(ins) == pos:
            return called, ins.name
    return None


def _reduced(uses: Callable[[str], Uses], comp: str, reduce: Instr,
             pos: int) -> list[Instr] | None:
    """What holds operand `pos`'s reduction after all-reduce `reduce` (its -done for an async
    one): the result itself, or for a tuple the get-tuple-elements of index pos; None when the
    tuple is used whole."""
    holder = reduce
    found = uses(comp).get(reduce.name, [])
    if len(found) == 1 and found[0][0].opcode.endswith("-done"):
        holder = found[0][0]
    if not holder.type.lstrip().startswith("("):
        return [holder]
    picked = []
    for user, _ in uses(comp).get(holder.name, []):
        index = attr(user.attrs, "index")
        if user.opcode != "get-tuple-element" or not (index or "").isdigit():
            return None
        if int(index) == pos:
            picked.append(user)
    return picked


def slice_only(comps: Mapping[str, Sequence[Instr]], uses: Callable[[str], Uses], comp: str,
               value: Instr, size: int, n: int, depth: int = 0, outer=None) -> bool:
    """Whether every use of `value` (in computation `comp`) keeps at most size / n of its
    `size` elements by slicing (module docstring); False for an unused or returned value.
    outer: (computation, fusion, its outer) when `comp` is a fusion's body, whose result is
    then followed in the caller; a further all-reduce of the value is followed to its result."""
    found = uses(comp).get(value.name, [])
    if depth > 32 or not (found or value.root):
        return False
    if value.root and (outer is None or not slice_only(comps, uses, outer[0], outer[1], size,
                                                       n, depth + 1, outer[2])):
        return False
    for user, pos in found:
        if user.opcode in _SLICES:
            ok = pos == 0 and elements(user.type) * n <= size
        elif user.opcode in _PASS_THROUGH or user.opcode.endswith("-done") or (
                user.opcode in _ELEMENTWISE and elements(user.type) == size):
            ok = slice_only(comps, uses, comp, user, size, n, depth + 1, outer)
        elif user.opcode.removesuffix("-start") == "all-reduce":
            held = _reduced(uses, comp, user, pos)
            ok = bool(held) and all(slice_only(comps, uses, comp, h, size, n, depth + 1, outer)
                                    for h in held)
        elif user.opcode == "fusion" and (target := _fusion_parameter(comps, user, pos)):
            fused, param = target
            inner = next(i for i in comps[fused] if i.name == param)
            ok = slice_only(comps, uses, fused, inner, size, n, depth + 1, (comp, user, outer))
        else:
            ok = False
        if not ok:
            return False
    return True


def scattered_parts(comps: Mapping[str, Sequence[Instr]], uses: Callable[[str], Uses],
                    comp: str, ins: Instr, n: int) -> list[str]:
    """Shape texts of the parts of all-reduce `ins` (in `comp`, group size n) whose result is
    only sliced to 1/n: the whole result for an array, tuple elements reached through
    get-tuple-element (through an async -done first) for a tuple."""
    parts = tuple_parts(ins.type)
    out = []
    for pos, part in enumerate(parts):
        held = _reduced(uses, comp, ins, pos)
        if held is None:
            return []  # the tuple itself is used: nothing can be said per element
        if held and all(slice_only(comps, uses, comp, h, elements(part), n) for h in held):
            out.append(part)
    return out
