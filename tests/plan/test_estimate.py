"""The analytic state bytes per device equal those of make_trainer's real shardings."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from maxmoe.config_files import load_config
from maxmoe.plan.estimate import state_bytes, state_leaves
from maxmoe.sharding import make_mesh
from maxmoe.train.step import make_trainer
from maxmoe.validation import dcn_sizes, validate

TINY = "configs/tiny.yaml"
MODELS = ["configs/models/tiny_deepseek_v3.yaml", "configs/models/tiny_mixtral.yaml"]
LAYOUTS = {  # name -> (devices, extra files, overrides)
    "1x1x1": (1, [], ["mesh.cpu_devices=1", "mesh.data=1", "mesh.fsdp=1", "mesh.expert=1"]),
    "fsdp8": (8, [], ["mesh.data=1", "mesh.fsdp=8", "mesh.expert=1"]),
    "fsdp2_expert2_tensor2": (8, ["configs/mesh/cpu8_fsdp_expert_tensor.yaml"], []),
    "pipeline": (8, ["configs/mesh/cpu8_pipeline.yaml"], ["model.num_dense_layers=1"]),
    "bf16_moments": (8, [], ["optimizer.moment_dtype=bfloat16"]),
}


def real_bytes(abstract_part) -> dict[str, int]:
    """{keystr path: bytes per device} from ShapeDtypeStructs carrying NamedShardings."""
    return {jax.tree_util.keystr(path): int(np.prod(leaf.sharding.shard_shape(leaf.shape)))
            * leaf.dtype.itemsize
            for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_part)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("model", MODELS)
def test_state_bytes_equal_make_trainer_shardings_leaf_for_leaf(model, layout):
    devices, files, overrides = LAYOUTS[layout]
    cfg, origins = load_config([TINY, model, *files], overrides)
    sizes = validate(cfg, devices, origins)
    trainer = make_trainer(cfg, make_mesh(sizes, jax.devices()[:devices], dcn=dcn_sizes(cfg)))
    leaves = state_leaves(cfg, sizes)
    for part in ("params", "opt_state", "buffers"):
        want = real_bytes(trainer.abstract_state.get(part, {}))
        assert {leaf.path: leaf.bytes for leaf in leaves[part]} == want, part
    estimate = state_bytes(cfg, sizes)
    totals = {part: sum(real_bytes(trainer.abstract_state.get(part, {})).values())
              for part in ("params", "opt_state", "buffers")}
    assert (estimate.params, estimate.opt_state, estimate.buffers) == (
        totals["params"], totals["opt_state"], totals["buffers"])
    assert estimate.total == sum(totals.values())
    assert estimate.grads == estimate.params  # float32 gradients of float32 master params
    if devices == 1:
        assert estimate.replicated == [] and estimate.replicated_bytes == 0
    if layout == "fsdp8" and "mixtral" in model:  # GQA: every matrix has an embed axis (fsdp)
        assert estimate.replicated_bytes < 0.05 * estimate.total


def test_a_weight_no_axis_divides_is_listed():
    base = [TINY, MODELS[0]]
    mesh = ["mesh.data=1", "mesh.fsdp=8", "mesh.expert=1"]

    def q_lora_entries(rank: int):
        # q_b [q_lora, heads 4, 12 + 8]: with q_lora 36 no dim divides by fsdp's 8
        cfg, origins = load_config(base, [*mesh, f"attention.q_lora_rank={rank}",
                                          "attention.qk_nope_head_dim=12",
                                          "attention.qk_rope_head_dim=8"])
        estimate = state_bytes(cfg, validate(cfg, 8, origins))
        return estimate, [path for path, _ in estimate.replicated
                          if "['q_b']" in path or "['q_a_norm']" in path]

    # q_b [q_lora, heads, head_dim] and q_a_norm [q_lora]: split while q_lora divides by 8
    sharded, in_sharded = q_lora_entries(64)
    replicated, in_replicated = q_lora_entries(36)
    assert in_sharded == []
    q_b = [p for p in in_replicated if "['q_b']" in p]
    assert any(p.startswith("params") for p in q_b) and any(".mu" in p for p in q_b)
    assert any(".nu" in p for p in q_b)
    assert replicated.replicated_bytes > sharded.replicated_bytes
    sizes = [b for _, b in replicated.replicated]
    assert sizes == sorted(sizes, reverse=True)
