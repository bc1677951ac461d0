"""Where the time of a compiled step goes: a JAX profiler trace, attributed to model parts.

`maxmoe bench CONFIG --profile DIR` traces a few steps with `jax.profiler`, then reads the
trace back with `jax.profiler.ProfileData` (no TensorBoard needed). Each executed XLA op (a
thunk on CPU, a kernel on GPU) is mapped to its HLO instruction in the compiled module and from
there to the `jax.named_scope` it was traced under (model/transformer.py, moe.py,
parallel/experts.py, kernels/grouped_matmul.py, train/step.py name the parts). Time is wall
time: a loop or call op counts only what its children do not, and ops running at once share
the moment. Forward and backward are told apart by the `transpose(` that JAX puts in the names
of backward ops. The trace itself is left in DIR for TensorBoard or Perfetto.
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

import jax

COLLECTIVES = "collectives (incl. waiting for peers)"
_COLLECTIVE_OPS = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                   "collective-permute", "ragged-all-to-all", "collective-broadcast"}
_OPCODE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (?:\([^=]*?\)|\S+) ([\w\-]+)\(")
# (category, scope path) in order, first match wins. A scope shows up as /name/ or, when a
# transform wraps it (unrolled layers, the LM head), as jvp(name)/ or transpose(jvp(name))/;
# under shard_map the expert parts sit below moe/shard_map/.
_S = r"[/(]{}(?=[/)]|$)"
PARTS = [(part, re.compile(r".*".join(_S.format(n) for n in path.split("/")))) for part, path in [
    ("optimizer", "optimizer"),
    ("moe: dispatch (sort, gather)", "moe/dispatch"),
    ("moe: grouped matmul", "moe/grouped_matmul"),
    ("moe: combine (scatter)", "moe/combine"),
    ("moe: router", "moe/router"),
    ("moe: shared experts", "moe/shared_experts"),
    ("moe: other", "moe"),
    ("attention: projections", "attention/projection"),
    ("attention: core", "attention"),
    ("dense mlp", "mlp"),
    ("lm head", "lm_head"),
    ("loss", "loss"),
    ("embedding", "embed"),
    ("layer scan (slice/stack per layer)", "while/body"),
]]
OTHER = "other (grad norm, guards, zero fills)"
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_OP_NAME = re.compile(r"metadata=\{[^}]*op_name=\"([^\"]*)\"")


def op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> op_name path (its jax name stack; "" when XLA made the op up, e.g.
    a zero fill it hoisted) from compiled HLO text."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            op = _OP_NAME.search(line)
            out[m.group(1)] = op.group(1) if op else ""
    return out


def collective_instructions(hlo_text: str) -> set[str]:
    """Names of cross-device ops (all-reduce, all-gather, ..., async -start/-done halves)."""
    out = set()
    for line in hlo_text.splitlines():
        m = _OPCODE.match(line)
        if m and m.group(2).removesuffix("-start").removesuffix("-done") in _COLLECTIVE_OPS:
            out.add(m.group(1))
    return out


def matmul_instructions(hlo_text: str) -> set[str]:
    """Names of dots, and of fusions whose fused computation holds a dot or a convolution."""
    with_dot, current, fusion_calls = set(), None, {}
    for line in hlo_text.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head:
            current = head.group(1)
            continue
        if current and re.search(r"= [^=]*\b(dot|convolution|ragged-dot)\(", line):
            with_dot.add(current)
            name = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) =", line)
            if name:
                with_dot.add(name.group(1))
        call = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*\bfusion\(.*calls=%?([\w.\-]+)", line)
        if call:
            fusion_calls[call.group(1)] = call.group(2)
    return with_dot | {f for f, c in fusion_calls.items() if c in with_dot}


def categorize(op_name: str, collective: bool = False) -> str:
    """The part an op belongs to: collectives first, else by its op_name path."""
    if collective:
        return COLLECTIVES
    for part, pattern in PARTS:
        if pattern.search(op_name):
            return part
    return OTHER


def instruction_times(trace_dir: Path, names: dict[str, str], module: str = "") -> dict[str, float]:
    """HLO instruction name -> ns of wall time in the newest trace, "" -> ns when no op ran.

    On each timeline the innermost running op owns the moment (a loop or call op counts only
    what its children do not cover); across timelines, ops running at the same moment share
    it equally. So the times add up to the traced span: on XLA:CPU two independent ops run at
    once on the two cores and each gets half, where summing thread time would count both in
    full.
    Events name their op in the `hlo_op` stat (GPU kernels have other names); GPU traces are
    read from the device planes only, so host-side launches are not counted twice."""
    files = sorted(Path(trace_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"{trace_dir}: the profiler wrote no *.xplane.pb")
    planes = list(jax.profiler.ProfileData.from_file(str(files[-1])).planes)
    device = [p for p in planes if p.name.startswith("/device:") and "CPU" not in p.name]
    segments = []
    for plane in device or planes:
        for line in plane.lines:
            spans = []
            for e in line.events:
                stats = dict(e.stats)
                if module and stats.get("hlo_module", module) != module:
                    continue
                name = stats.get("hlo_op", e.name)
                if name in names:  # every instruction, loops and calls included
                    spans.append((e.start_ns, e.start_ns + e.duration_ns, name))
            segments += _innermost(spans)
    return _share(segments)


def _innermost(spans) -> list[tuple[int, int, str]]:
    """Nested (start, end, name) spans of one timeline -> disjoint segments, each owned by
    the innermost span running then."""
    spans = [sp for sp in spans if sp[1] > sp[0]]
    points = sorted([(s, 1, -e, k) for k, (s, e, _) in enumerate(spans)]
                    + [(e, 0, 0, k) for k, (_, e, _) in enumerate(spans)])
    out, stack, last = [], [], None
    for t, starting, _, k in points:  # ends before starts at equal times; outer spans first
        if stack and t > last:
            out.append((last, t, spans[stack[-1]][2]))
        last = t
        if starting:
            stack.append(k)
        elif k in stack:
            stack.remove(k)
    return out


def _share(segments) -> dict[str, float]:
    """Segments of all timelines -> name -> ns, each moment split among the segments running
    then; "" gets the moments inside the span when none runs."""
    points = sorted([(s, 1, n) for s, _, n in segments] + [(e, -1, n) for _, e, n in segments])
    out: dict[str, float] = collections.defaultdict(float)
    running: collections.Counter = collections.Counter()
    last = points[0][0] if points else 0
    for t, delta, name in points:
        if t > last:
            busy = sum(running.values())
            for n, count in running.items():
                if count:
                    out[n] += (t - last) * count / busy
            if not busy:
                out[""] += t - last
        running[name] += delta
        last = t
    return out


def breakdown(trace_dir: Path, hlo_text: str, steps: int) -> dict[str, list[dict]]:
    """{"parts": rows {part, forward_ms, backward_ms, matmul_ms, total_ms, share} per step in
    wall time (see instruction_times), largest first, then IDLE; "ops": up to TOP rows
    {op, op_name, total_ms, share} of the costliest ops}."""
    names, matmuls = op_names(hlo_text), matmul_instructions(hlo_text)
    collectives = collective_instructions(hlo_text)
    module = re.match(r"\s*HloModule ([\w.\-]+)", hlo_text)
    times = instruction_times(trace_dir, names, module.group(1) if module else "")
    idle = times.pop("", 0.0) / 1e6 / steps
    rows = collections.defaultdict(lambda: collections.Counter())
    for name, ns in times.items():
        op, ms = names[name], ns / 1e6 / steps
        row = rows[categorize(op, name in collectives)]
        row["backward_ms" if "transpose(" in op else "forward_ms"] += ms
        if name in matmuls:
            row["matmul_ms"] += ms
    total = (sum(times.values()) / 1e6 / steps + idle) or 1.0
    out = [{"part": part, "forward_ms": r["forward_ms"], "backward_ms": r["backward_ms"],
            "matmul_ms": r["matmul_ms"], "total_ms": r["forward_ms"] + r["backward_ms"],
            "share": (r["forward_ms"] + r["backward_ms"]) / total} for part, r in rows.items()]
    out = sorted(out, key=lambda r: -r["total_ms"]) + [
        {"part": IDLE, "forward_ms": 0.0, "backward_ms": 0.0, "matmul_ms": 0.0,
         "total_ms": idle, "share": idle / total}]
    top = sorted(times.items(), key=lambda kv: -kv[1])[:TOP]
    return {"parts": out,
            "ops": [{"op": name, "op_name": names[name], "total_ms": ns / 1e6 / steps,
                     "share": ns / 1e6 / steps / total} for name, ns in top]}


TOP = 12
IDLE = "idle (no op running)"


def table(profile: dict[str, list[dict]]) -> str:
    rows, ops = profile["parts"], profile["ops"]
    lines = [f"{'part':<38} {'fwd ms':>8} {'bwd ms':>8} {'total':>8} {'share':>6} {'matmul':>7}"]
    for r in rows:
        lines.append(f"{r['part']:<38} {r['forward_ms']:>8.1f} {r['backward_ms']:>8.1f} "
                     f"{r['total_ms']:>8.1f} {100 * r['share']:>5.1f}% {r['matmul_ms']:>7.1f}")
    total = sum(r["total_ms"] for r in rows)
    mm = sum(r["matmul_ms"] for r in rows)
    lines.append(f"{'all (wall time of the traced steps)':<38} {'':>8} {'':>8} {total:>8.1f} "
                 f"{'':>6} {mm:>7.1f}")
    lines.append("costliest ops:")
    for r in ops:
        lines.append(f"  {r['total_ms']:7.1f} ms {100 * r['share']:5.1f}%  {r['op']:<34} "
                     f"{r['op_name'][-80:]}")
    return "\n".join(lines)
