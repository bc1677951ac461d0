"""Model presets: parameter counts from abstract shapes (nothing allocated) against the
published figures, and metrics/flops.py's analytic active count against the same shapes.

Published totals are given to 3 significant figures: we require 1%. Published active counts
are 2-figure roundings whose convention differs by vendor (Mistral and Qwen count the
embedding table, DeepSeek does not), so each preset states its convention and the tolerance
is 2.5%: the worst case is V2-Lite (2.45B for "2.4B", +2.1%), the others are within 1.6%.
"""

from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from maxmoe.config import load_config
from maxmoe.validation import validate
from maxmoe.metrics.flops import active_params_per_token
from maxmoe.model.router import RouterBias
from maxmoe.train.step import build_model

PRESETS = Path(__file__).resolve().parents[2] / "configs" / "models"

# name -> (total, active, the published active count includes the embedding table)
PUBLISHED = {
    "deepseek_v3_671b": (671e9, 37e9, False),
    "deepseek_v2_lite": (15.7e9, 2.4e9, False),
    "mixtral_8x7b": (46.7e9, 12.9e9, True),
    "qwen3_moe_30b_a3b": (30.5e9, 3.3e9, True),
}


def count(cfg) -> dict[str, int]:
    """total / active / embedding / mtp param counts of the abstract model."""
    model = nnx.eval_shape(lambda: build_model(cfg, 0))
    out = dict(total=0, active=0, embedding=0, mtp=0)
    k_over_e = cfg.moe.experts_per_token / cfg.moe.num_experts
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        size = int(np.prod(v.get_value().shape))
        if path[0] == "mtp":
            out["mtp"] += size
            continue
        out["total"] += size
        if path[0] == "embed":
            out["embedding"] += size
        elif "experts" in v.get_metadata()["axes"]:
            out["active"] += round(size * k_over_e)  # only the top-k routed experts run
        else:
            out["active"] += size
    return out


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_counts_match_published(name):
    cfg, origins = load_config([str(PRESETS / f"{name}.yaml")])
    validate(cfg, 1, origins)
    counts = count(cfg)
    total, active, with_embedding = PUBLISHED[name]
    ours_active = counts["active"] + (counts["embedding"] if with_embedding else 0)
    print(f"{name}: total {counts['total'] / 1e9:.2f}B (published {total / 1e9}B), active "
          f"{ours_active / 1e9:.2f}B (published {active / 1e9}B), MTP {counts['mtp'] / 1e9:.2f}B")
    assert abs(counts["total"] / total - 1) < 0.01
    assert abs(ours_active / active - 1) < 0.025
    assert active_params_per_token(cfg) == counts["active"]


@pytest.mark.parametrize("name", sorted(p.stem for p in PRESETS.glob("*.yaml")))
def test_every_preset_validates_and_flops_agree(name):
    files = ([str(PRESETS.parents[0] / "tiny.yaml")] if name.startswith("tiny") else []) + [
        str(PRESETS / f"{name}.yaml")]
    cfg, origins = load_config(files)
    validate(cfg, 8 if name.startswith("tiny") else 1, origins)
    assert active_params_per_token(cfg) == count(cfg)["active"]
    if cfg.moe.router == "sigmoid":  # the selection bias exists and is not a trainable param
        model = nnx.eval_shape(lambda: build_model(cfg, 0))
        assert jax.tree.leaves(nnx.state(model, RouterBias))
