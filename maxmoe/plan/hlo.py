"""HLO module text as printed by `compiled.as_text()`: computations of instructions (name,
result shape, opcode, operands, attributes, whether it is the ROOT) and the byte sizes of
shapes, elements, operand names and attribute values, the computations an instruction runs and
a loop's known trip count. Enough for maxmoe.plan.collectives, maxmoe.plan.scatter and
maxmoe.plan.compiled_flops (all their HLO text parsing is here), not a full HLO parser."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([<=\d,]*)\]")
_PARAM = re.compile(r"^\s*(\d+)\s*$")
_CALLEE_KEYS = ("calls", "to_apply", "body", "condition", "branch_computations",
                "true_computation", "false_computation", "called_computations")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')


def _uncommented(text: str) -> str:
    """text without its /* ... */ comments."""
    return re.sub(r"/\*.*?\*/", "", text)


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    type: str  # result shape text, e.g. "f32[4,8]{1,0}" or a tuple "(f32[4], s32[])"
    opcode: str
    operands: list[str]  # as printed: "%name" or "f32[4] %name"
    attrs: str
    root: bool = False  # the computation's ROOT (its result)


def dtype_bytes(dtype: str) -> float:
    """Bytes of one element of an HLO primitive type (pred 1, bf16 2, s4 0.5, c64 8...)."""
    if dtype == "pred":
        return 1.0
    if dtype in ("token", "opaque"):
        return 0.0
    m = re.match(r"[a-z]+?(\d+)", dtype)
    if not m:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(m.group(1)) / 8


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape text (arrays and tuples; layouts and comments ignored)."""
    total = 0.0
    for dtype, dims in _SHAPE.findall(_uncommented(shape)):
        sizes = [int(d.replace("<=", "")) for d in dims.split(",") if d]
        total += dtype_bytes(dtype) * int(np.prod(sizes, dtype=np.int64))
    return total


def elements(shape: str) -> int:
    """Elements of one array shape text (`f32[64,128]{1,0}` -> 8192; a scalar -> 1)."""
    m = _SHAPE.search(_uncommented(shape))
    if not m:
        raise ValueError(f"not an array shape: {shape!r}")
    total = 1
    for d in m.group(2).split(","):
        if d:
            total *= int(d.replace("<=", ""))
    return total


def tuple_parts(type_: str) -> list[str]:
    """Element shape texts of a tuple shape `(a, b)`; [type_] for an array."""
    text = _uncommented(type_).strip()
    return split_top(text[1:-1]) if text.startswith("(") else [text]


def operand_name(operand: str) -> str:
    """`%x` or `f32[4] %x` -> `x`."""
    return operand.rsplit(None, 1)[-1].lstrip("%")


def split_top(text: str, sep: str = ",") -> list[str]:
    """Splits at `sep` outside (), [], {}."""
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def close_bracket(text: str, start: int) -> int:
    """Index of the bracket closing the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced brackets in HLO: {text[:120]!r}")


def attr(attrs: str, key: str) -> str | None:
    """The value text of `key=` in an attribute list (bracket-balanced; "" when the list ends
    at the `=`), None if absent."""
    m = re.search(rf"(?:^|[\s,]){key}=", attrs)
    if not m:
        return None
    i = m.end()
    if attrs[i:i + 1] in ("{", "[", "("):
        end = close_bracket(attrs, i) + 1
        if attrs[i] == "[" and attrs[end:end + 2] == "<=":  # iota form [G,N]<=[dims]T(perm)
            end = close_bracket(attrs, end + 2) + 1
            if attrs[end:end + 2] == "T(":
                end = close_bracket(attrs, end + 1) + 1
        return attrs[i:end]
    return re.match(r"[^,\s]*", attrs[i:]).group(0)


def parameter_number(ins: Instr) -> int | None:
    """N of a `parameter(N)` instruction; None for any other."""
    if ins.opcode != "parameter" or not ins.operands or not _PARAM.match(ins.operands[0]):
        return None
    return int(ins.operands[0])


def callees(ins: Instr) -> list[str]:
    """Computations an instruction runs (body, condition, branches, calls, to_apply...)."""
    names = []
    for key in _CALLEE_KEYS:
        value = attr(ins.attrs, key)
        if value:
            names += re.findall(r"%?([\w.\-]+)", value.strip("{}"))
    return names


def known_trip_count(ins: Instr) -> int | None:
    """A `while`'s trip count from its backend_config (known_trip_count), None if unknown."""
    m = _TRIP.search(ins.attrs)
    return int(m.group(1)) if m else None


def parse_instruction(line: str) -> Instr | None:
    """One HLO instruction line -> Instr; None for anything else."""
    m = _INSTR.match(_uncommented(line))
    if not m:
        return None
    name, rest = m.group(1), m.group(2).strip()
    end = close_bracket(rest, 0) + 1 if rest.startswith("(") else rest.index(" ")
    type_, rest = rest[:end], rest[end:].strip()
    paren = rest.find("(")
    if paren < 0:
        return None
    close = close_bracket(rest, paren)
    return Instr(name, type_, rest[:paren].strip(), split_top(rest[paren + 1:close]),
                 rest[close + 1:].lstrip(", "), bool(re.match(r"\s*ROOT\s", line)))


def parse_module(hlo_text: str) -> tuple[dict[str, list[Instr]], str]:
    """HLO module text -> ({computation: instructions}, entry computation name)."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
        elif line.strip() == "}":
            current = None
        elif current is not None and (ins := parse_instruction(line)):
            comps[current].append(ins)
    if not entry:
        raise ValueError("HLO text has no ENTRY computation")
    return comps, entry
