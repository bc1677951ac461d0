"""The search's analytic MoE buffer rows (`search.moe_rows`) against the dispatch's own slot
arithmetic, worked by hand here."""

from maxmoe.config_files import load_config
from maxmoe.plan import search
from maxmoe.validation import validate


def test_capacity_rows_are_whole_slots_per_sequence():
    # 16 sequences of 100 tokens over data 8: 2 sequences a device. Capacity per expert per
    # sequence = ceil(1.1 x 100 x K 2 / E 8) = ceil(27.5) = 28 slots; the [E, C] buffer holds
    # 8 experts x (2 sequences x 28) = 448 rows (the factor x T x K shortcut gives 440).
    cfg, origins = load_config(
        ["configs/tiny.yaml"], ["mesh.data=8", "mesh.fsdp=1", "mesh.expert=1",
                                "data.seq_len=100", "data.global_batch_size=16",
                                "moe.dispatch=capacity", "moe.capacity_factor=1.1"])
    sizes = validate(cfg, 8, origins, 1)
    layout = search.Layout(sizes, dict.fromkeys(sizes, 1), "full", 1)
    t = search.tokens_per_device(cfg, sizes, 1)
    assert t == 200
    assert search.moe_rows(cfg, layout, t) == 448
