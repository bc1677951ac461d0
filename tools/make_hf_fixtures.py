"""Regenerates tests/fixtures/hf/<name>/: tiny random Hugging Face MoE models and their outputs.

Needs torch + transformers (not needed by the test suite, which reads the committed files):

    pip install torch==2.13.0 && pip install transformers safetensors
    python tools/make_hf_fixtures.py            # all fixtures
    python tools/make_hf_fixtures.py NAME ...   # only these (each keeps its seed)
    python tools/make_hf_fixtures.py --generate-only [NAME ...]   # only generate.npy, from
        # the committed model.safetensors (the other files stay byte-identical)

Each fixture directory holds config.json and model.safetensors (as `save_pretrained` writes
them, hub tensor names), input_ids.npy [B, S], logits.npy [B, S, V] (float32, eager attention
and experts), experts.npz (`layer_<i>`: the [B*S, K] expert ids the router picked) and
generate.npy [B, S + GENERATE_TOKENS] (int32: input_ids, then HF `generate`'s greedy tokens in
float32 with the KV cache, EOS stopping off).
HF's random init leaves norms at 1 and DeepSeek's e_score_correction_bias at 0, which would hide
bugs, so both are perturbed. Weights are rounded to bfloat16 where the fixture is saved in
bfloat16, so the float32 reference logits are exactly those of the saved weights.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
BATCH, SEQ = 2, 12
GENERATE_TOKENS = 8
COMMON = dict(vocab_size=64, hidden_size=16, initializer_range=0.25, max_position_embeddings=256,
              tie_word_embeddings=False)


def yarn(factor, mscale=None, mscale_all_dim=None, theta=10000.0, original=32):
    p = dict(rope_type="yarn", rope_theta=theta, factor=factor,
             original_max_position_embeddings=original, beta_fast=32.0, beta_slow=1.0)
    if mscale is not None:
        p["mscale"] = mscale
    if mscale_all_dim is not None:
        p["mscale_all_dim"] = mscale_all_dim
    return p


DEEPSEEK = dict(COMMON, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                intermediate_size=32, moe_intermediate_size=8, kv_lora_rank=8, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=6, rms_norm_eps=1e-5)

# name -> (model class, config, dtype on disk, config.json rewrites)
FIXTURES = {
    # q-lora, interleaved RoPE, YaRN with mscale == mscale_all_dim, 4 groups pick 2, one shared
    "deepseek_v3_qlora_interleave_yarn": (DeepseekV3ForCausalLM, DeepseekV3Config(**dict(
        DEEPSEEK, q_lora_rank=12, rope_interleave=True, n_routed_experts=16,
        num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters=yarn(4.0, mscale=1.0, mscale_all_dim=1.0))), "float32", {}),
    # no q-lora, rotate-half, YaRN with mscale != mscale_all_dim, no groups, 2 shared, no
    # dense layer, no renormalisation; config.json in the old rope_scaling + rope_theta style
    "deepseek_v3_full_q_rotate_half": (DeepseekV3ForCausalLM, DeepseekV3Config(**dict(
        DEEPSEEK, q_lora_rank=None, rope_interleave=False, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=2,
        first_k_dense_replace=0, norm_topk_prob=False, routed_scaling_factor=1.5,
        rope_parameters=yarn(8.0, mscale=0.707, mscale_all_dim=1.3, theta=5000.0))),
        "bfloat16", {"old_rope_style": True}),
    # plain RoPE, 2 groups pick 1, 3 shared experts, 2 first dense layers
    "deepseek_v3_groups_dense": (DeepseekV3ForCausalLM, DeepseekV3Config(**dict(
        DEEPSEEK, num_hidden_layers=4, q_lora_rank=6, rope_interleave=True, n_routed_experts=8,
        num_experts_per_tok=3, n_group=2, topk_group=1, n_shared_experts=3,
        first_k_dense_replace=2, norm_topk_prob=True, routed_scaling_factor=1.0,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0))), "bfloat16", {}),
    # GQA, head_dim 8 != hidden / heads = 4
    "mixtral": (MixtralForCausalLM, MixtralConfig(**dict(
        COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=12, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="default", rope_theta=1e6))), "bfloat16", {}),
    # dense layers by decoder_sparse_step, renormalised top-k; config says num_experts
    "qwen3_moe_sparse_step": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**dict(
        COMMON, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=24, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1e6))), "float32",
        {"experts_key": "num_experts"}),
    # dense layers by mlp_only_layers, no renormalisation, YaRN without mscale
    "qwen3_moe_mlp_only_yarn": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**dict(
        COMMON, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=12,
        intermediate_size=24, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=3,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False, rms_norm_eps=1e-6,
        rope_parameters=yarn(2.0, theta=1e6))), "bfloat16", {}),
    # DeepSeek-V2-Lite's shape: no q-lora, greedy top-k (n_group 1), no renormalisation, scale 1,
    # 2 shared experts, 1 first dense layer, YaRN with mscale == mscale_all_dim = 0.707;
    # config.json in the hub file's style (rope_scaling + rope_theta, DeepSeek-only keys)
    "deepseek_v2_lite_greedy": (DeepseekV2ForCausalLM, DeepseekV2Config(**dict(
        DEEPSEEK, q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=3,
        topk_method="greedy", n_group=1, topk_group=1, n_shared_experts=2,
        first_k_dense_replace=1, norm_topk_prob=False, routed_scaling_factor=1.0,
        rope_parameters=yarn(40.0, mscale=0.707, mscale_all_dim=0.707))), "bfloat16",
        {"old_rope_style": True, "extra": dict(scoring_func="softmax", moe_layer_freq=1,
                                               aux_loss_alpha=0.001, seq_aux=True)}),
    # q-lora, 4 groups of 4 ranked by their best score pick 2 (group_limited_greedy), top-4,
    # routed scale 2.5, norm_topk_prob true (which transformers ignores), one shared expert,
    # 2 first dense layers, YaRN with mscale != mscale_all_dim
    "deepseek_v2_groups_qlora_scaled": (DeepseekV2ForCausalLM, DeepseekV2Config(**dict(
        DEEPSEEK, num_hidden_layers=4, q_lora_rank=12, n_routed_experts=16,
        num_experts_per_tok=4, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        n_shared_experts=1, first_k_dense_replace=2, norm_topk_prob=True,
        routed_scaling_factor=2.5, rope_parameters=yarn(4.0, mscale=1.0, mscale_all_dim=0.5))),
        "float32", {}),
}


def perturb(model: torch.nn.Module, gen: torch.Generator, dtype: torch.dtype) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            p.copy_(p.to(dtype).to(torch.float32))  # exactly representable on disk
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_((0.1 * torch.randn(b.shape, generator=gen)).to(dtype).to(torch.float32))


def record_experts(model) -> dict[str, list]:
    """Forward hooks on every router: its third output is the [T, K] expert ids."""
    picked: dict[str, list] = {}
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and not isinstance(gate, torch.nn.Linear):
            gate.register_forward_hook(
                lambda _m, _in, out, i=i: picked.__setitem__(f"layer_{i}", out[2].numpy()))
    return picked


def rewrite_config(path: Path, options: dict) -> None:
    cfg = json.loads(path.read_text())
    if options.get("old_rope_style"):
        rope = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = rope.pop("rope_theta")
        rope["type"] = rope.pop("rope_type")
        cfg["rope_scaling"] = rope
    if options.get("experts_key"):
        cfg[options["experts_key"]] = cfg.pop("num_local_experts")
    cfg.update(options.get("extra", {}))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def greedy_generation(model, ids: torch.Tensor) -> np.ndarray:
    """[B, S + GENERATE_TOKENS] int32: HF greedy decoding (float32, KV cache) of every row,
    EOS stopping off so that each row gets all its tokens."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=GENERATE_TOKENS, min_new_tokens=GENERATE_TOKENS,
                             do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones_like(ids))
    assert out.shape == (ids.shape[0], ids.shape[1] + GENERATE_TOKENS), out.shape
    return out.numpy().astype(np.int32)


def write_generation(name: str) -> None:
    """generate.npy of fixture `name` from its committed weights (loaded into the HF model in
    float32; their logits are checked against the committed logits.npy first)."""
    cls, config, _, _ = FIXTURES[name]
    out = OUT / name
    config._attn_implementation = "eager"
    model = cls.from_pretrained(out, config=config, dtype=torch.float32).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    ids = torch.from_numpy(np.load(out / "input_ids.npy").astype(np.int64))
    with torch.no_grad():
        logits = model(ids).logits.float().numpy()
    err = np.abs(logits - np.load(out / "logits.npy")).max()
    if err > 1e-5:
        raise SystemExit(f"{name}: committed weights give logits {err:.2e} off logits.npy")
    generated = greedy_generation(model, ids)
    np.save(out / "generate.npy", generated)
    print(f"{name}: generate.npy {list(generated.shape)} (logits check {err:.1e})")


def main(names: list[str]) -> None:
    unknown = sorted(set(names) - set(FIXTURES))
    if unknown:
        raise SystemExit(f"unknown fixture(s) {unknown}; known: {sorted(FIXTURES)}")
    for seed, (name, (cls, config, dtype, options)) in enumerate(FIXTURES.items()):
        if names and name not in names:
            continue
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        config._attn_implementation = "eager"
        model = cls(config).eval()
        model.set_experts_implementation("eager") if hasattr(model, "set_experts_implementation") else None
        perturb(model, gen, getattr(torch, dtype))
        ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
        picked = record_experts(model)
        with torch.no_grad():
            logits = model(ids).logits.float().numpy()
        out = OUT / name
        shutil.rmtree(out, ignore_errors=True)
        model.to(getattr(torch, dtype)).save_pretrained(out)
        (out / "generation_config.json").unlink(missing_ok=True)
        rewrite_config(out / "config.json", options)
        np.save(out / "input_ids.npy", ids.numpy().astype(np.int32))
        np.save(out / "logits.npy", logits)
        np.savez(out / "experts.npz", **picked)
        np.save(out / "generate.npy", greedy_generation(model.to(torch.float32), ids))
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"{name}: {size / 1024:.0f} KiB, logits std {logits.std():.3f}, "
              f"{len(picked)} MoE layers")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--generate-only"]:
        for fixture in sys.argv[2:] or list(FIXTURES):
            write_generation(fixture)
    else:
        main(sys.argv[1:])
