"""moe.overlap_chunks under XLA:GPU's deviceless compile: the expert all-to-all is emitted as
async start/done pairs, and with two token chunks XLA:GPU schedules expert GEMMs between a
ragged all-to-all's start and done (one chunk's exchange under the other's experts). With one
chunk tiny's schedule has none, so the check fails on the old layout: the forward's dispatch ->
GEMM -> combine is one chain (the backward's recompute leaves a little independent work, which
larger shapes' schedules use: docs/performance/gpu.md, "`moe.overlap_chunks`: two token chunks
per MoE layer"). Without the latency-hiding scheduler (train/step.XLA_GPU_OPTIONS emptied)
XLA:GPU makes ragged all-to-alls synchronous. The `gpu_aot` group; tiny on 16 deviceless H100s in 2 hosts
(data 2 x fsdp 2 x expert 4, the expert axis across the hosts), all_to_all in one round (no
rounds loop: a collective inside a while overlaps nothing outside it), bf16.
"""

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="jax[cuda12] plugin not installed")
pytest.importorskip("tokamax", reason="tokamax not installed")

from maxmoe.cluster import load_cluster  # noqa: E402
from maxmoe.plan import live  # noqa: E402
from maxmoe.plan.gpu_aot import ragged_exchanges  # noqa: E402
from maxmoe.plan.probe import compile_step, compiled_figures, overlap_figures  # noqa: E402
from maxmoe.train import step  # noqa: E402

pytestmark = pytest.mark.gpu_aot

TINY = ["configs/tiny.yaml", "precision.compute_dtype=bfloat16", "mesh.data=2", "mesh.fsdp=2",
        "mesh.expert=4", "mesh.dcn_expert=2", "moe.transport=all_to_all",
        "moe.transport_rounds=1", "data.global_batch_size=32"]


def compiled_with(chunks: int):
    return compile_step([*TINY, f"moe.overlap_chunks={chunks}"], 16, 2, "gpu", "h100")[:2]


def exchanges_of(chunks: int) -> list[dict]:
    return ragged_exchanges(compiled_with(chunks)[1].as_text())


@pytest.fixture(scope="module")
def compiles():
    return {chunks: compiled_with(chunks) for chunks in (1, 2)}


@pytest.fixture(scope="module")
def exchanges(compiles):
    return {chunks: ragged_exchanges(c.as_text()) for chunks, (_, c) in compiles.items()}


def test_every_ragged_all_to_all_is_an_async_pair(exchanges):
    for chunks, found in exchanges.items():
        assert found and all(r["async"] for r in found), (chunks, found)
    assert len(exchanges[2]) == 2 * len(exchanges[1])  # each chunk its own exchanges


def test_two_chunks_put_expert_gemms_under_the_exchanges(exchanges):
    assert not any(r["gemms_between"] for r in exchanges[1])  # one chunk: the check fires
    assert any(r["gemms_between"] for r in exchanges[2])


def test_without_the_latency_hiding_scheduler_some_are_synchronous(monkeypatch):
    monkeypatch.setattr(step, "XLA_GPU_OPTIONS", {})
    found = exchanges_of(2)
    assert found and not all(r["async"] for r in found)


def test_a_job_on_gpus_reads_its_overlap_from_the_schedule(compiles):
    """plan/live.py (a real job's plan.json and --dry-run) on GPUs prices the exposed
    communication from the compiled schedule, as `maxmoe plan --compiler gpu` does: the same
    figure from the same compile; off GPUs it stays assumed (tests/train/test_resume.py)."""
    setup, compiled = compiles[2]
    cluster = load_cluster("16xh100")
    figures = live.live_figures(setup, compiled, cluster, 1.0)
    assert figures["overlap_source"] == "schedule"
    hlo = compiled.as_text()
    measured = compiled_figures(setup, compiled, cluster.devices_per_host, hlo)
    expected = overlap_figures(hlo, setup.trainer.mesh, cluster.devices_per_host, cluster,
                               measured, None)["exposed_communication_s"]
    assert figures["exposed_communication_s"] == pytest.approx(expected, rel=1e-9)
