"""plan/sites.py: the overlap's exposed and total seconds grouped by kind x link x site.

Synthetic schedules written by hand (tests/plan/test_overlap.py's helpers); each expected figure
is derived from plan/overlap.py's rule and the shapes here. Tolerance: float rounding (rel 1e-9).
"""

import pytest

from maxmoe.plan.overlap import overlap_line
from maxmoe.plan.sites import by_site, site
from tests.plan.test_overlap import DCN, DOT_S, ICI, dot, gather_s, module, overlap


def scoped_start(name: str, elements: int, groups: str, op_name: str) -> str:
    return (f"  %{name} = (f32[{elements}]{{0}}, f32[{2 * elements}]{{0}}) all-gather-start("
            f"%p{elements}), channel_id=1, replica_groups={groups}, dimensions={{0}}, "
            f'use_global_device_ids=true, metadata={{op_name="{op_name}"}}')


def done(name: str, elements: int) -> str:
    return f"  %{name}.done = f32[{2 * elements}]{{0}} all-gather-done(%{name})"


HOP1 = "jit(train_step)/while/body/moe/dispatch/ragged_all_to_all"
HOP1_BWD = ("jit(train_step)/transpose(jvp(checkpoint))/while/body/moe/combine/"
            "ragged_all_to_all")
HOP2 = "jit(train_step)/while/body/moe/exchange_rounds/while/body/dispatch/ragged_all_to_all"
RECOMPUTE = ("jit(train_step)/transpose(jvp(vmap()))/vmap(vmap())/checkpoint/"
             "rematted_computation/moe/shard_map/dispatch/jit(_where)/select_n")
HOP2_BWD = ("jit(train_step)/transpose(jvp(vmap()))/checkpoint/moe/shard_map/exchange_rounds/"
            "transpose(jvp(combine))/convert_element_type")
AHEAD = ("jit(train_step)/while/body/rerun_ahead/vmap()/moe/shard_map/combine/"
         "ragged_all_to_all")
HEAD = "jit(train_step)/transpose(jvp())/while/body/eval_jaxpr/lm_head/bcd,bcv->dv/dot_general"


@pytest.mark.parametrize("kind,op_name,want", [
    ("ragged-all-to-all", HOP1, "moe dispatch hop1 fwd"),
    ("ragged-all-to-all", HOP1_BWD, "moe combine hop1 bwd"),
    ("ragged-all-to-all", HOP2, "moe dispatch rounds fwd"),
    ("ragged-all-to-all", RECOMPUTE, "moe dispatch hop1 recompute"),
    ("ragged-all-to-all", HOP2_BWD, "moe combine rounds bwd"),
    ("ragged-all-to-all", AHEAD, "moe combine hop1 ahead"),
    ("all-reduce", HEAD, "lm head bwd"),
    ("collective-permute", "jit(train_step)/while/body/ppermute", "pipeline permute fwd"),
    ("all-gather", "", "(no op_name)"),
])
def test_site_labels(kind, op_name, want):
    assert site(kind, op_name) == want


def test_exposed_seconds_are_grouped_by_kind_link_and_site():
    """Two hop-1 gathers over DCN (one hidden under a dot, one not), one lm_head gather on ICI
    exposed: the hop-1 group sums both, the head's is its own group; the groups add up to the
    overlap's totals."""
    a, b, c = 256, 4096, 1024
    lines = [scoped_start("a", a, DCN, HOP1), dot("f1"), done("a", a),
             scoped_start("b", b, DCN, HOP1), done("b", b),
             scoped_start("c", c, ICI, HEAD), done("c", c)]
    result = overlap(module(lines, (a, b, c)))
    rows = {(r["link"], r["site"]): r for r in by_site(result.collectives)}
    assert set(rows) == {("dcn", "moe dispatch hop1 fwd"), ("ici", "lm head bwd")}
    hop1, head = rows["dcn", "moe dispatch hop1 fwd"], rows["ici", "lm head bwd"]
    ta, tb, tc = gather_s(a, "dcn"), gather_s(b, "dcn"), gather_s(c, "ici")
    assert ta > 0 and tb > 0 and tc > 0
    assert hop1["collectives"] == 2 and hop1["times"] == 2
    assert hop1["seconds"] == pytest.approx(ta + tb, rel=1e-9)
    assert hop1["exposed_s"] == pytest.approx(max(0.0, ta - DOT_S) + tb, rel=1e-9)
    assert head["exposed_s"] == pytest.approx(tc, rel=1e-9)
    assert sum(r["exposed_s"] for r in rows.values()) == pytest.approx(result.exposed_s,
                                                                      rel=1e-9)
    ranked = result.to_json()["by_site"]
    assert [r["exposed_s"] for r in ranked] == sorted((r["exposed_s"] for r in ranked),
                                                      reverse=True)
    text = overlap_line(result.to_json())
    assert "exposed by site: " in text and "dcn moe dispatch hop1 fwd (x2)" in text
