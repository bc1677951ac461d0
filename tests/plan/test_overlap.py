"""plan/overlap.py's rule on scheduled HLO written by hand.

Each expected figure is derived here from the module docstring's rule and the shapes in the text:
a collective's time is its bytes (collectives.py's all-gather convention, (n-1) x operand per
device) over the link's bandwidth; a compute op's is max(FLOPs / flops, bytes / HBM bandwidth)
with a dot's FLOPs 2 M N K (at the GEMM rate) and its bytes operands + result. Tolerance: float rounding (rel 1e-9).
"""

import io
import math

import jax
import pytest

from maxmoe.plan.overlap import Rates, schedule_overlap
from maxmoe.plan.planner import plan
from maxmoe.plan.roofline import step_time
from tests.plan.test_roofline import TOY

RATES = Rates(gemm_flops=1e9, attention_flops=5e8, hbm_bandwidth=2e9, ici_bandwidth=4e6,
              dcn_bandwidth=1e6)
HOST = 4  # devices per host: {0,1} share a host (ici), {0,4} do not (dcn)
ICI, DCN = "{{0,1},{2,3},{4,5},{6,7}}", "{{0,4},{1,5},{2,6},{3,7}}"
M = 64  # the fused dot is [M, M] x [M, M], float32
DOT_S = max(2 * M**3 / RATES.gemm_flops, 3 * M * M * 4 / RATES.hbm_bandwidth)

FUSED = f"""%fused_dot (x: f32[{M},{M}], y: f32[{M},{M}]) -> f32[{M},{M}] {{
  %x = f32[{M},{M}]{{1,0}} parameter(0)
  %y = f32[{M},{M}]{{1,0}} parameter(1)
  ROOT %d = f32[{M},{M}]{{1,0}} dot(%x, %y), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""


def gather_s(elements: int, link: str) -> float:
    """Roofline time of an all-gather of f32[elements] over pairs: (2-1) x operand bytes."""
    bandwidth = RATES.ici_bandwidth if link == "ici" else RATES.dcn_bandwidth
    return (2 - 1) * elements * 4 / bandwidth


def start(name: str, elements: int, groups: str, extra: str = "") -> str:
    return (f"  %{name} = (f32[{elements}]{{0}}, f32[{2 * elements}]{{0}}) all-gather-start("
            f"%p{elements}), channel_id=1, replica_groups={groups}, dimensions={{0}}, "
            f'use_global_device_ids=true, metadata={{op_name="step/{name}"}}{extra}')


def done(name: str, elements: int) -> str:
    return f"  %{name}.done = f32[{2 * elements}]{{0}} all-gather-done(%{name})"


def dot(name: str) -> str:
    return f"  %{name} = f32[{M},{M}]{{1,0}} fusion(%a, %a), kind=kOutput, calls=%fused_dot"


def module(lines: list[str], sizes: tuple[int, ...], extra: str = "") -> str:
    """A scheduled module: parameters a (the dot's operand) and p<n> (f32[n] to gather)."""
    params = [f"  %a = f32[{M},{M}]{{1,0}} parameter(0)"] + [
        f"  %p{n} = f32[{n}]{{0}} parameter({i + 1})" for i, n in enumerate(sizes)]
    return ("HloModule m, is_scheduled=true\n\n" + FUSED + extra
            + "ENTRY %main (a: f32[64,64]) -> f32[64,64] {\n"
            + "\n".join(params + lines) + f"\n  ROOT %r = f32[{M},{M}]{{1,0}} copy(%a)\n}}\n")


def overlap(text: str):
    mesh = jax.make_mesh((8,), ("x",))
    return schedule_overlap(text, mesh, HOST, RATES)


def _exposed(result) -> dict[str, float]:
    return {c.name: c.exposed_s for c in result.collectives}


COPY_S = 2 * M * M * 4 / RATES.hbm_bandwidth  # the ROOT copy: read and write


@pytest.mark.parametrize("elements", [16384, 256])  # longer than the two dots, then shorter
def test_compute_between_start_and_done_hides_the_collective(elements):
    text = module([start("ag", elements, ICI), dot("f1"), dot("f2"), done("ag", elements)],
                  (elements,))
    result = overlap(text)
    t = gather_s(elements, "ici")
    assert result.communication_s == pytest.approx(t, rel=1e-9)
    assert result.exposed_s == pytest.approx(max(0.0, t - 2 * DOT_S), rel=1e-9)
    assert result.compute_s == pytest.approx(2 * DOT_S + COPY_S, rel=1e-9)
    assert not result.to_json()["synchronous"]


def test_one_op_is_credited_to_one_collective_only():
    """ICI then DCN in flight over one dot: the dot's time goes to the first started, the rest
    (if any) to the second, never to both."""
    a, b = 256, 4096  # t_a < dot < t_b
    ta, tb = gather_s(a, "ici"), gather_s(b, "dcn")
    assert ta < DOT_S < tb
    text = module([start("a", a, ICI), start("b", b, DCN), dot("f1"), done("a", a),
                   done("b", b)], (a, b))
    exposed = _exposed(overlap(text))
    assert exposed["a"] == pytest.approx(0.0, abs=1e-15)
    assert exposed["b"] == pytest.approx(tb - (DOT_S - ta), rel=1e-9)
    assert sum(exposed.values()) > ta + tb - 2 * DOT_S  # what crediting the dot twice gives


@pytest.mark.parametrize("link_a", ["ici", "dcn"])
def test_collectives_on_one_link_are_serialised(link_a):
    """a (long) starts, then b (short); one dot; b's done; a long dot; a's done. On b's link a
    must finish before b: a's rest is exposed at b's done and the long dot hides nothing. On
    another link, a's rest hides under the long dot."""
    a, b = 1024, 512
    ta, tb = gather_s(a, link_a), gather_s(b, "ici")
    lines = [start("a", a, ICI if link_a == "ici" else DCN), start("b", b, ICI), dot("f1"),
             done("b", b), dot("f2"), dot("f3"), dot("f4"), dot("f5"), done("a", a)]
    exposed = _exposed(overlap(module(lines, (a, b))))
    rest_a = ta - min(DOT_S, ta)  # credit goes to a first (started first)
    rest_b = tb - min(tb, DOT_S - min(DOT_S, ta))
    assert rest_a > 0
    assert exposed["b"] == pytest.approx(rest_b, rel=1e-9)
    want_a = rest_a if link_a == "ici" else max(0.0, rest_a - 4 * DOT_S)
    assert exposed["a"] == pytest.approx(want_a, rel=1e-9, abs=1e-15)
    assert (want_a < rest_a) == (link_a == "dcn")


def test_synchronous_collectives_are_fully_exposed_and_listed():
    n = 4096
    t = gather_s(n, "ici")
    sync = (f"  %ag = f32[{2 * n}]{{0}} all-gather(%p{n}), channel_id=2, replica_groups={ICI}, "
            f'dimensions={{0}}, use_global_device_ids=true, metadata={{op_name="step/sync"}}')
    marked = start("m", n, ICI, ', backend_config={"collective_backend_config":'
                                '{"is_sync":true}}')
    lines = [dot("f0"), sync, dot("f1"), marked, dot("f2"), dot("f3"), done("m", n)]
    result = overlap(module(lines, (n,)))
    assert result.exposed_s == pytest.approx(2 * t, rel=1e-9)
    listed = result.to_json()["synchronous"]
    assert {(c["kind"], c["op_name"]) for c in listed} == {("all-gather", "step/sync"),
                                                           ("all-gather", "step/m")}
    assert [c["bytes"] for c in listed] == [pytest.approx((2 - 1) * n * 4)] * 2


def test_a_loop_body_counts_trip_count_times_and_lends_its_spare_compute():
    """Inside the body: a gather over one dot, then a second dot, 5 trips. Around the loop: a
    gather whose start and done enclose the while; it hides under the body's compute that hid
    none of the body's own gathers."""
    inner, outer, trips = 1024, 4096, 5
    tuple_t = f"(f32[{M},{M}]{{1,0}}, f32[{inner}]{{0}})"
    body = (f"%body (arg: {tuple_t}) -> {tuple_t} {{\n  %arg = {tuple_t} parameter(0)\n"
            f"  %a = f32[{M},{M}]{{1,0}} get-tuple-element(%arg), index=0\n"
            f"  %p{inner} = f32[{inner}]{{0}} get-tuple-element(%arg), index=1\n"
            + "\n".join([start("in", inner, ICI), dot("g"), done("in", inner), dot("h")])
            + f"\n  ROOT %t = {tuple_t} tuple(%g, %p{inner})\n}}\n"
            f"%cond (c: {tuple_t}) -> pred[] {{\n  %c = {tuple_t} parameter(0)\n"
            "  ROOT %k = pred[] constant(true)\n}\n")
    loop = (f"  %init = {tuple_t} tuple(%a, %p{inner})\n  %w = {tuple_t} while(%init), "
            f'condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"{trips}"}}}}')
    lines = [start("out", outer, ICI), loop, done("out", outer)]
    result = overlap(module(lines, (inner, outer), extra=body))
    t_in, t_out = gather_s(inner, "ici"), gather_s(outer, "ici")
    spare = DOT_S - min(DOT_S, t_in) + DOT_S  # what the first dot left, and the second
    exposed = _exposed(result)
    assert exposed["in"] == pytest.approx(trips * max(0.0, t_in - DOT_S), abs=1e-15)
    assert 0 < t_out - trips * spare and exposed["in"] > 0
    assert exposed["out"] == pytest.approx(t_out - trips * spare, rel=1e-9)
    assert result.communication_s == pytest.approx(trips * t_in + t_out, rel=1e-9)
    assert result.compute_s == pytest.approx(trips * 2 * DOT_S + COPY_S, rel=1e-9)


def test_step_time_takes_the_measured_exposed_time():
    sent = {"x": {"all-gather": {"ici": 3.6e11, "dcn": 0.0}}}
    step = step_time(1.6e13, 16, TOY, sent, 0.0, efficiency=1.0, exposed_comm_s=0.25)
    assert step.exposed_comm_s == 0.25
    assert step.step_s == pytest.approx(step.compute_s + 0.25, rel=1e-12)


@pytest.mark.gpu_aot
@pytest.mark.slow
def test_plan_reads_the_overlap_from_the_xla_gpu_schedule():
    """`maxmoe plan configs/tiny.yaml --compiler gpu` on 8 deviceless H100s: the exposed time
    comes from the schedule, is finite, and is at most the step's collective time (the same
    bytes over the same bandwidths)."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="jax[cuda12] plugin not installed")
    pytest.importorskip("tokamax", reason="tokamax not installed")
    out = io.StringIO()
    best = plan(["configs/tiny.yaml", "precision.compute_dtype=bfloat16"], "8xh100",
                compiler="gpu", out=out)["best"]
    total = best["step_time_parts_s"]["ici"] + best["step_time_parts_s"]["dcn"]
    exposed = best["exposed_communication_s"]
    assert best["overlap_source"] == "schedule" and best["compiler"] == "gpu"
    assert math.isfinite(exposed) and 0 <= exposed <= total * (1 + 1e-9)
    assert best["overlap"]["communication_s"] == pytest.approx(total, rel=1e-9)
    assert best["step_time_s"] == pytest.approx(best["compute_s"] + exposed, rel=1e-9)
    assert "overlap read from XLA:GPU's schedule" in out.getvalue()
