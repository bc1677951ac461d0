"""moe.collectives_in_flight under XLA:GPU's deviceless compile: with two_level and two token
chunks, the hop-1 exchange across hosts (one chunk's) stays in flight while a hop-2 exchange
inside the host starts (the two links busy at once, and hop 1 under the other chunk's expert
work). XLA:GPU's default (1 collective in flight) never schedules two collectives together, so
the check fails without the setting. The `gpu_aot` group; tiny DeepSeek-V3 on 16 deviceless
H100s in 2 hosts (data 2 x fsdp 2 x expert 4, the expert axis across the hosts: hop 1 pairs
devices of the two hosts), transport two_level in one round, two chunks, bf16.
"""

import re

import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="jax[cuda12] plugin not installed")
pytest.importorskip("tokamax", reason="tokamax not installed")

from maxmoe.plan.gpu_aot import ragged_exchanges  # noqa: E402
from maxmoe.plan.probe import compile_step  # noqa: E402

pytestmark = pytest.mark.gpu_aot

PER_HOST = 8
TINY = ["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml",
        "precision.compute_dtype=bfloat16", "mesh.data=2", "mesh.fsdp=2", "mesh.expert=4",
        "mesh.dcn_expert=2", "moe.transport=two_level", "moe.transport_rounds=1",
        "moe.overlap_chunks=2", "data.global_batch_size=32"]


def exchanges_of(in_flight: int) -> list[dict]:
    """The step's ragged_exchanges, each with "across_hosts": whether its groups pair devices
    of different hosts (hop 1; partition i is the mesh's device i, its host id // PER_HOST)."""
    setup, compiled, _ = compile_step([*TINY, f"moe.collectives_in_flight={in_flight}"], 16, 2,
                                      "gpu", "h100")
    host = [d.id // PER_HOST for d in setup.trainer.mesh.devices.flat]
    found = ragged_exchanges(compiled.as_text())
    for row in found:
        groups = re.findall(r"\{([\d,]+)\}", row["replica_groups"] or "")
        row["across_hosts"] = any(len({host[int(p)] for p in g.split(",")}) > 1
                                  for g in groups)
    return found


@pytest.fixture(scope="module")
def exchanges():
    return {n: exchanges_of(n) for n in (1, 2)}


def test_both_hops_are_there(exchanges):
    for n, found in exchanges.items():
        assert any(r["across_hosts"] for r in found), n
        assert not all(r["across_hosts"] for r in found), n
    assert all(r["async"] for r in exchanges[2])


def test_two_in_flight_put_another_exchange_under_hop_1(exchanges):
    assert not any(r["starts_between"] for r in exchanges[1])  # XLA's default: one at a time
    assert any(r["starts_between"] for r in exchanges[2] if r["across_hosts"])
