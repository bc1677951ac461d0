"""The model-FLOPs count MFU is measured with agrees with MaxText's
`calculate_tflops_training_per_device` (maxtext_utils.py), the convention docs/observability.md
documents."""

import pytest

from maxmoe.config_files import load_config
from maxmoe.metrics.flops import (
    attention_flops_per_token,
    block_active_params,
    flops_per_token,
    pipelined_reruns,
    pipelined_share,
    recompute_factor,
)
from tests.helpers import small_config

REFERENCE = "configs/bench/cpu_mixtral_tiny.yaml"
# MaxText's own count for the CPU reference shape (Mixtral-style decoder, dropless MoE, causal
# attention halved), for the whole step on its one device
MAXTEXT_STEP_FLOPS = 4.842e10


def maxtext_training_flops(cfg) -> float:
    """MaxText's training FLOPs for one device, written out from its formula for a GQA decoder
    with a softmax-routed dropless MoE: 3 x (forward matmuls of every layer + the LM head) + 3 x
    causal attention; its embedding FLOPs are the LM head's, norms are not counted."""
    m, a, e = cfg.model, cfg.attention, cfg.moe
    tokens = cfg.data.global_batch_size * cfg.data.seq_len  # per device: one device here
    d, hd = m.hidden_size, a.head_dim
    gate = 2 * tokens * d * e.num_experts
    ffn = 2 * tokens * e.expert_mlp_size * d * 3  # gate and up (two activations) + down
    qkv = 2 * tokens * d * (a.num_heads + 2 * a.num_kv_heads) * hd
    projection = 2 * tokens * d * a.num_heads * hd
    embedding = 2 * tokens * d * m.vocab_size
    noncausal = 4 * cfg.data.global_batch_size * cfg.data.seq_len**2 * a.num_heads * hd
    learnable = ((gate + ffn * e.experts_per_token + qkv + projection) * m.num_layers + embedding) * 3
    return learnable + noncausal / 2 * m.num_layers * 3


def test_reference_shape_matches_maxtext_within_one_percent():
    cfg, _ = load_config([REFERENCE])
    assert cfg.model.num_dense_layers == 0 and cfg.moe.num_shared_experts == 0  # what the formula covers
    assert maxtext_training_flops(cfg) == pytest.approx(MAXTEXT_STEP_FLOPS, rel=1e-3)
    ours = flops_per_token(cfg) * cfg.data.global_batch_size * cfg.data.seq_len
    assert ours == pytest.approx(MAXTEXT_STEP_FLOPS, rel=0.01)


@pytest.mark.parametrize("preset", ["configs/models/tiny_deepseek_v3.yaml",
                                    "configs/models/tiny_mixtral.yaml"])
def test_attention_is_counted_causally(preset):
    """Scores and values over a causal S x S triangle: half of the full product's 2 x S x (qk + v)
    FLOPs a head and token forward, x3 with the backward; doubling S doubles it per token."""
    cfg, _ = load_config(["configs/tiny.yaml", preset])
    a, m, s = cfg.attention, cfg.model, cfg.data.seq_len
    qk, v = ((a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim) if a.kind == "mla"
             else (a.head_dim, a.head_dim))
    full = 3 * 2 * s * (qk + v) * a.num_heads * (m.num_layers + m.mtp_depth)
    assert attention_flops_per_token(cfg) == pytest.approx(full / 2)
    longer, _ = load_config(["configs/tiny.yaml", preset], [f"data.seq_len={2 * s}"])
    assert attention_flops_per_token(longer) == pytest.approx(2 * attention_flops_per_token(cfg))


def test_recompute_factor_counts_each_forward_run_again():
    """recompute_factor: 1 + 1/3 per forward re-run, by the FLOPs share of the layers re-run.
    Unpipelined: 1 (remat none) and 4/3 (full). Pipelined (tests/helpers SMALL, 5 layers of
    which 4 MoE on 2 stages: 2 slots a stage; 3 layers: 1 slot): pipelined_reruns per MoE
    layer, their share s of the FLOPs: none 1 + s/3; full at 2 slots 1 + (1 + s/2)/3 (the
    stage's re-run of the first slot on top of the blocks'), at one slot 4/3. The re-runs
    themselves are compiled in tests/plan/test_gpu_pipeline_reruns.py."""
    def factor(stages, *overrides):
        cfg, _ = small_config("model.num_layers=5", *overrides)
        return recompute_factor(cfg, stages)
    assert factor(1, "model.remat_policy=none") == 1.0
    assert factor(1, "model.remat_policy=full") == pytest.approx(4 / 3)
    cfg, _ = small_config("model.num_layers=5")
    moe = 4 * (6 * block_active_params(cfg, True) + attention_flops_per_token(cfg) / 5)
    share = moe / flops_per_token(cfg)
    assert 0.5 < share < 1
    assert pipelined_reruns("full", 2) == 1.5 and pipelined_reruns("none", 2) == 1.0
    assert factor(2, "model.remat_policy=none") == pytest.approx(1 + share / 3)
    assert factor(2, "model.remat_policy=full") == pytest.approx(1 + (1 + share / 2) / 3)
    assert factor(2, "model.remat_policy=full", "model.num_layers=3") == pytest.approx(4 / 3)


def test_pipelined_share_is_the_pipelined_layers_part_of_the_run_flops():
    """pipelined_share: the pipelined MoE layers' FLOPs (each forward re-run adding 1/3) over
    the step's (recompute_factor's): tests/helpers SMALL, 5 layers (1 dense, 4 MoE pipelined
    on 2 stages, 2 slots), s their share of the model FLOPs. Remat none: the stage's pass
    re-run once, s (1 + 1/3) over 1 + s/3; full: s (1 + 1.5/3) over 1 + (1 + s/2)/3 (the dense
    layer and LM head re-run once, the MoE layers 1.5 times). 0 on one stage."""
    def share(stages, *overrides):
        cfg, _ = small_config("model.num_layers=5", *overrides)
        return pipelined_share(cfg, stages)
    cfg, _ = small_config("model.num_layers=5")
    moe = 4 * (6 * block_active_params(cfg, True) + attention_flops_per_token(cfg) / 5)
    s = moe / flops_per_token(cfg)
    assert share(1) == 0.0
    assert share(2, "model.remat_policy=none") == pytest.approx(s * 4 / 3 / (1 + s / 3))
    assert share(2, "model.remat_policy=full") == pytest.approx(s * 1.5 / (1 + (1 + s / 2) / 3))
