"""Where a step's communication sits: a short site label for each collective of the compiled
schedule, read from its op_name (the jax name stack XLA keeps in the HLO metadata), and the
exposed and total seconds of plan/overlap.py grouped by kind x link x site, so the plan says
which exchanges stay exposed, not only the few most exposed collectives (issue 41, item 5).

A site is the model scope the collective sits in (the named scopes of maxmoe/model and
maxmoe/parallel: "moe", "lm_head", "attention", "embed", ...), refined for the MoE exchanges:
- "moe dispatch" / "moe combine": the named scope of the exchange (parallel/dispatch.py,
  parallel/all_to_all.py, parallel/two_level.py); "hop1" outside the round loop's scope
  (two_level's exchange across hosts), "rounds" inside it (all_to_all's exchange, two_level's
  hop 2 inside the host), "expert" for other MoE collectives;
- the pass: "recompute" for the rematerialised forward of a checkpointed layer (jax's
  "rematted_computation" scope), "ahead" for the pipeline backward's re-run of a stage's
  slots one iteration ahead (parallel/pipeline.AHEAD_SCOPE), "bwd" under a transpose (the
  backward), else "fwd";
- "pipeline permute" for a collective-permute with no model scope (parallel/pipeline.py moves
  the stage outputs), "(no op_name)" where XLA kept none.
XLA keeps no op_name on the async ragged all-to-alls; plan/overlap.py gives them that of the
data they send (sent_op_name), so an exchange whose rows come straight from the previous
exchange's scope takes that scope (two_level's hop-1 combine sends hop 2's combined rows:
"moe combine rounds" on the dcn link is hop 1's). Under two_level the link tells the hops
apart: dcn is hop 1, ici hop 2.
"""

from __future__ import annotations

import re

from maxmoe.parallel.all_to_all import ROUNDS_SCOPE
from maxmoe.parallel.pipeline_loop import AHEAD_SCOPE

# a scope under transforms, e.g. "transpose(jvp(combine))" or "vmap(router)": the scope
_WRAPPED = re.compile(r"^(?:[a-z_]+\()+([a-z_]+)\)+$")
# model scopes a site is named after, innermost wins (maxmoe/model's named scopes)
_SCOPES = ("lm_head", "loss", "embed", "mtp", "attention", "router", "shared_experts", "moe",
           "mlp", "dispatch", "combine")


def _scopes(op_name: str) -> list[str]:
    """The named scopes of an op_name, outermost first, noise and the primitive dropped."""
    parts = [(m.group(1) if (m := _WRAPPED.match(p)) else p) for p in op_name.split("/")[:-1]]
    return [p for p in parts if p in _SCOPES or p == ROUNDS_SCOPE]


def site(kind: str, op_name: str) -> str:
    """The module docstring's short label of a collective of `kind` with `op_name`."""
    if not op_name:
        return "(no op_name)"
    scopes = _scopes(op_name)
    phase = ("recompute" if "rematted_computation" in op_name
             else "ahead" if AHEAD_SCOPE in op_name.split("/")
             else "bwd" if "transpose(" in op_name else "fwd")
    named = [s for s in scopes if s in _SCOPES]
    exchange = next((s for s in reversed(named) if s in ("dispatch", "combine")), None)
    if exchange is not None:
        hop = "rounds" if ROUNDS_SCOPE in scopes else "hop1"
        return f"moe {exchange} {hop} {phase}"
    if ROUNDS_SCOPE in scopes or "ragged" in kind:
        return f"moe expert {phase}"
    if named:
        return f"{named[-1].replace('_', ' ')} {phase}"
    if kind == "collective-permute":
        return f"pipeline permute {phase}"
    return f"other {phase}"


def by_site(collectives) -> list[dict]:
    """plan/overlap.py's Collectives grouped by (kind, link, site): {"kind", "link", "site",
    "collectives" (instructions), "times" (executions per step), "seconds" (their roofline
    seconds per step), "exposed_s"}, most exposed first."""
    groups: dict[tuple[str, str, str], dict] = {}
    for c in collectives:
        key = (c.kind, c.link, site(c.kind, c.op_name))
        row = groups.setdefault(key, {"kind": key[0], "link": key[1], "site": key[2],
                                      "collectives": 0, "times": 0.0, "seconds": 0.0,
                                      "exposed_s": 0.0})
        row["collectives"] += 1
        row["times"] += c.times
        row["seconds"] += c.time_s * c.times
        row["exposed_s"] += c.exposed_s
    return sorted(groups.values(), key=lambda r: (-r["exposed_s"], -r["seconds"]))


def site_lines(rows: list[dict], top: int = 6) -> list[str]:
    """`maxmoe plan`'s lines of the `top` most exposed sites: exposed of total seconds, the
    kind, link and site, the executions per step."""
    return [f"{r['exposed_s']:.3g} of {r['seconds']:.3g} s {r['kind']} {r['link']} "
            f"{r['site']} (x{r['times']:g})" for r in rows[:top] if r["seconds"] > 0]
