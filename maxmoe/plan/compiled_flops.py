"""The matmul FLOPs a compiled train step runs, per device, beside the model's FLOPs
(metrics.flops, per device): a step that runs far more than the model needs has a dense
expansion (XLA's RaggedDotRewriter runs every routed row through every local expert) or
recompute the remat policy did not intend.

Two counts, both per device and per step:
- `xla_cost_analysis_flops`: `compiled.cost_analysis()["flops"]` as XLA gives it. XLA counts a
  `while` body once, not trip-count times, so a step of scanned layers reads far low (tiny,
  XLA:CPU: 4 layers 1.388e9, 7 layers 1.398e9; docs/gpu_aot.md); it also counts elementwise
  work and gives custom calls no FLOPs. Reported as XLA's figure, not compared.
- `compiled_flops`: dot and cuBLAS-GEMM FLOPs (2 x result elements x contracted size) read from
  the optimised HLO, each `while` body counted known_trip_count times (hlo.known_trip_count;
  nested loops multiply), a `conditional` by its costliest branch. A loop whose trip count
  depends on the data (no known_trip_count: the blocked CPU stand-in's block loops) counts once,
  which may be more or less than it runs: `loops_counted_once` says how many. Custom calls other than
  cuBLAS GEMMs (tokamax's Mosaic GPU kernels, cuDNN attention, TopK) are not counted: their
  FLOPs are unknown to the HLO, so where kernels run as custom calls the figure is a lower
  bound, and `uncounted_custom_calls` lists them.

The check compares compiled_flops with the model's per-device FLOPs (6 x active params +
causal attention; remat recompute not counted): `allowed` is metrics.flops.recompute_factor,
the forwards the remat policy and a pipeline's per-iteration remat may run again. `verdict`:
- "not judged" where a loop was counted once (the count is no bound either way), `flag` None;
- "flagged" where the ratio exceeds 1.2 x allowed, `flag` True;
- "within (a lower bound)" where custom calls were left uncounted: a ratio under the limit then
  proves nothing about the kernels' own work; "within" otherwise; `flag` False for both.
On the deviceless XLA:GPU compile cost_analysis() gives None (jax 0.12.0.1).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re

from maxmoe.plan.hlo import (
    Instr,
    attr,
    callees,
    known_trip_count,
    operand_name,
    parse_module,
    tuple_parts,
)

TOLERANCE = 1.2  # compiled over model FLOPs beyond allowed x this is flagged
_DIMS = re.compile(r"\[([\d,]*)\]")
_GEMM = re.compile(r'custom_call_target="(__cublas\$[^"]*)"')
_CALL = re.compile(r'custom_call_target="([^"]+)"')
_LHS_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')


@dataclasses.dataclass
class Tally:
    """One execution's count: matmul FLOPs, custom calls left out (target -> count), loops
    without a known trip count (counted once)."""
    flops: float = 0.0
    uncounted: dict[str, float] = dataclasses.field(default_factory=dict)
    loops_once: int = 0

    def add(self, other: Tally, times: float = 1.0) -> None:
        self.flops += times * other.flops
        for k, v in other.uncounted.items():
            self.uncounted[k] = self.uncounted.get(k, 0) + times * v
        self.loops_once += other.loops_once


def _dims(type_: str) -> list[int]:
    m = _DIMS.search(tuple_parts(type_)[0])
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def instruction_flops(ins: Instr, types: dict[str, str]) -> float | None:
    """FLOPs of one dot or cuBLAS GEMM custom call (types: instruction name -> result shape
    text, for the lhs); None for any other instruction."""
    if ins.opcode == "dot":
        contracting = attr(ins.attrs, "lhs_contracting_dims") or "{}"
    elif ins.opcode == "custom-call" and _GEMM.search(ins.attrs):
        m = _LHS_CONTRACTING.search(ins.attrs)
        contracting = m.group(1).replace('"', "") if m else ""
    else:
        return None
    lhs = _dims(types[operand_name(ins.operands[0])])
    size = math.prod(lhs[int(i)] for i in re.findall(r"\d+", contracting))
    return 2.0 * math.prod(_dims(ins.type)) * size


def matmul_flops(hlo_text: str) -> Tally:
    """The module docstring's compiled_flops of an optimised HLO module's entry computation."""
    comps, entry = parse_module(hlo_text)

    @functools.cache
    def cost(name: str) -> Tally:
        total, types = Tally(), {ins.name: ins.type for ins in comps[name]}
        for ins in comps[name]:
            flops = instruction_flops(ins, types)
            if flops is not None:
                total.flops += flops
            elif ins.opcode == "custom-call" and (call := _CALL.search(ins.attrs)):
                total.uncounted[call.group(1)] = total.uncounted.get(call.group(1), 0) + 1
            subs = [cost(c) for c in callees(ins) if c in comps]
            if ins.opcode == "conditional":
                subs = [max(subs, key=lambda t: t.flops)] if subs else []
            times = 1.0
            if ins.opcode == "while":
                trip = known_trip_count(ins)
                times = 1.0 if trip is None else float(trip)
                total.loops_once += trip is None
            for sub in subs:
                total.add(sub, times)
        return total

    return cost(entry)


def xla_flops(compiled) -> float | None:
    """compiled.cost_analysis()'s "flops" (a dict, or a list of one per program), or None."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else {}
    value = (analysis or {}).get("flops")
    return None if value is None else float(value)


def flops_check(hlo_text: str, compiled, model_flops_per_device: float, allowed: float) -> dict:
    """The plan's FLOPs figures and check (module docstring), JSON-ready."""
    tally = matmul_flops(hlo_text)
    ratio = tally.flops / model_flops_per_device
    uncounted = {k: round(v) for k, v in sorted(tally.uncounted.items())}
    if tally.loops_once:
        flag, verdict = None, "not judged"
    elif ratio > TOLERANCE * allowed:
        flag, verdict = True, "flagged"
    else:
        flag, verdict = False, "within (a lower bound)" if uncounted else "within"
    return {"compiled_flops_per_device": tally.flops,
            "xla_cost_analysis_flops_per_device": xla_flops(compiled),
            "model_flops_per_device": model_flops_per_device,
            "ratio": ratio, "allowed": allowed, "flag": flag, "verdict": verdict,
            "uncounted_custom_calls": uncounted, "loops_counted_once": tally.loops_once}


def check_line(check: dict) -> str:
    """One line for `maxmoe plan`: the two FLOPs figures, their ratio, and the verdict."""
    limit = f"{TOLERANCE:g} x {check['allowed']:.2f}"
    verdict = {
        "flagged": f"FLAGGED, over {limit} (a dense expansion, or recompute the remat policy "
                   "does not intend: see the largest buffers)",
        "not judged": f"not judged: {check['loops_counted_once']} loops whose trip count "
                      "depends on the data were counted once",
    }.get(check["verdict"], f"{check['verdict']} {limit}")
    notes = []
    if check["uncounted_custom_calls"]:
        notes.append("custom calls not counted (the HLO does not give their FLOPs): "
                     + json.dumps(check["uncounted_custom_calls"]))
    xla = check["xla_cost_analysis_flops_per_device"]
    notes.append("XLA's cost_analysis: " + ("none" if xla is None else
                 f"{xla:.3e} (while bodies counted once; not compared)"))
    return (f"compiled matmul FLOPs {check['compiled_flops_per_device']:.3e} per device vs "
            f"model {check['model_flops_per_device']:.3e}: {check['ratio']:.2f}x, {verdict}; "
            + "; ".join(notes))
