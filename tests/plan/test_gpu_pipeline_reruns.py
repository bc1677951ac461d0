"""What a pipelined step runs again in the backward, as XLA:GPU compiles it (the `gpu_aot`
group): the hop-1 row buffers two_level sends across hosts per pipeline iteration are exactly
prerank.hop1_reruns' count, which metrics.flops.pipelined_reruns prices the compute by. Under
remat full a stage's backward re-runs its slots but the last one iteration ahead
(parallel/pipeline_loop.Loop), and each block's vjp re-runs the block's forward: at 2 slots the
dispatch 1.5 times more per layer, and the combine 0.5; the last backward iteration runs one
such pass no iteration reads (2 row buffers more a step). Under none a stage's backward runs its
slots' forward once. Small model (tests/helpers SMALL, 5 layers of which 4 MoE, hidden 512),
bf16, pipeline 2 x expert 4 on 8 deviceless H100s in 2 hosts, gpipe, 2 microbatches (3
iterations).
"""
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="jax[cuda12] plugin not installed")
pytest.importorskip("tokamax", reason="tokamax not installed")

from maxmoe.parallel.schedule import pipeline_schedule  # noqa: E402
from maxmoe.plan.collectives import collective_bytes  # noqa: E402
from maxmoe.plan.prerank import hop1_exchanges, hop1_reruns  # noqa: E402
from maxmoe.plan.probe import compile_step  # noqa: E402
from tests.helpers import SMALL  # noqa: E402

pytestmark = pytest.mark.gpu_aot

PIPELINED = [*SMALL, "precision.compute_dtype=bfloat16", "mesh.pipeline=2", "mesh.expert=4",
             "mesh.dcn_expert=2", "moe.num_experts=16", "moe.experts_per_token=4",
             "moe.num_groups=4", "moe.groups_per_token=2", "moe.transport=two_level",
             "model.num_layers=5", "model.hidden_size=512"]  # a row buffer > all small ones


@pytest.mark.parametrize("remat,want_rows,unread", [("full", 12, 2), ("none", 11, 0)])
def test_pipelined_hop_one_row_buffers_are_the_priced_count(remat, want_rows, unread):
    setup, compiled, _ = compile_step([*PIPELINED, f"model.remat_policy={remat}"], 8, 2,
                                      "gpu", "h100")
    cfg = setup.cfg
    comm = collective_bytes(compiled.as_text(), setup.trainer.mesh, devices_per_host=4)
    m, hosts, moe_layers = cfg.model, cfg.mesh.dcn_expert, cfg.model.num_layers - 1
    schedule = pipeline_schedule(m, cfg.mesh.pipeline)
    slots = schedule.slots(moe_layers)
    assert schedule.pipelines(moe_layers) and slots == 2
    tokens = cfg.data.global_batch_size * cfg.data.seq_len // 4 // schedule.microbatches
    rows = (hosts - 1) * tokens * m.hidden_size * 2  # bf16
    small = (hosts - 1) * tokens * cfg.moe.experts_per_token * 4  # float32 weights, int32 ids
    exchanges, _ = hop1_exchanges(*hop1_reruns(remat, schedule.slots(moe_layers)))
    assert slots * exchanges == pytest.approx(want_rows)
    total = comm.by_axis["expert"]["all-to-all"]["dcn"]
    assert total // rows == schedule.iterations * want_rows + unread
    assert small <= total % rows  # router weights, expert ids and the row counts
