"""Hugging Face config.json <-> maxmoe model / attention / moe sections.

Families: deepseek_v3 (MLA, sigmoid group-limited routing, shared experts, first-k dense),
mixtral (GQA, softmax top-k), qwen3_moe (GQA with q/k norm, softmax top-k, dense layers by
decoder_sparse_step / mlp_only_layers). Both RoPE styles are read: transformers 5
`rope_parameters` (with rope_theta inside) and the older `rope_scaling` + top-level `rope_theta`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxmoe.config import AttentionConfig, Config, ModelConfig, MoEConfig
from maxmoe.convert.safetensors_io import ConversionError

FAMILIES = ("deepseek_v3", "mixtral", "qwen3_moe")


def _need(hf: dict, key: str, family: str) -> Any:
    if hf.get(key) is None:
        raise ConversionError(f"config.json: '{key}' is missing, but a {family} model needs it; "
                              "add it to config.json")
    return hf[key]


def _rope(hf: dict, family: str) -> dict:
    """AttentionConfig RoPE fields from either config style."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    out: dict = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind != "yarn":
        raise ConversionError(f"config.json: rope type {kind!r} is not supported; maxmoe reads "
                              "default and yarn RoPE")
    if params.get("attention_factor") is not None:
        raise ConversionError("config.json: rope 'attention_factor' is not supported; remove it "
                              "(maxmoe derives it from factor, mscale and mscale_all_dim)")
    return dict(out, rope_scaling="yarn", rope_factor=float(params["factor"]),
                rope_original_max_positions=int(params.get("original_max_position_embeddings")
                                                or hf.get("max_position_embeddings", 4096)),
                rope_beta_fast=float(params.get("beta_fast") or 32.0),
                rope_beta_slow=float(params.get("beta_slow") or 1.0),
                rope_truncate=bool(params.get("truncate", True)),
                rope_mscale=float(params.get("mscale") or 0.0),
                rope_mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))


def family_of(hf: dict) -> str:
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ConversionError(f"config.json: model_type {family!r} is not supported; maxmoe "
                              f"converts {', '.join(FAMILIES)}")
    return family


def config_from_hf(hf: dict, mtp_depth: int = 0, base: Config | None = None) -> Config:
    """A maxmoe Config whose model, attention and moe sections compute what the HF model does."""
    family = family_of(hf)
    if hf.get("tie_word_embeddings"):
        raise ConversionError("config.json: tie_word_embeddings=true is not supported; maxmoe "
                              "keeps a separate LM head")
    if hf.get("attention_bias"):
        raise ConversionError("config.json: attention_bias=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"config.json: hidden_act {hf['hidden_act']!r}: only silu is supported")
    if hf.get("use_sliding_window"):
        raise ConversionError("config.json: use_sliding_window=true is not supported")
    need = lambda key: _need(hf, key, family)  # noqa: E731
    heads = need("num_attention_heads")
    model = dict(vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
                 num_layers=need("num_hidden_layers"), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                 dense_mlp_size=need("intermediate_size"), num_dense_layers=0, mtp_depth=mtp_depth)
    attention = dict(num_heads=heads, **_rope(hf, family))
    if family == "deepseek_v3":
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConversionError("config.json: deepseek_v3 with scoring_func other than sigmoid "
                                  "is not supported")
        model.update(num_dense_layers=hf.get("first_k_dense_replace") or 0)
        attention.update(kind="mla", num_kv_heads=heads, q_lora_rank=hf.get("q_lora_rank") or 0,
                         kv_lora_rank=need("kv_lora_rank"), qk_nope_head_dim=need("qk_nope_head_dim"),
                         qk_rope_head_dim=need("qk_rope_head_dim"), v_head_dim=need("v_head_dim"),
                         rope_interleave=bool(hf.get("rope_interleave", True)))
        moe = dict(num_experts=need("n_routed_experts"), experts_per_token=need("num_experts_per_tok"),
                   expert_mlp_size=need("moe_intermediate_size"),
                   num_shared_experts=hf.get("n_shared_experts") or 0,
                   normalize_top_k=bool(hf.get("norm_topk_prob", True)), router="sigmoid",
                   num_groups=hf.get("n_group") or 1, groups_per_token=hf.get("topk_group") or 1,
                   routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                   # DeepSeek-V3's published balancing recipe (2.1.2, 4.2): no aux loss
                   aux_loss_weight=0.0, z_loss_weight=0.0, bias_update_speed=0.001,
                   sequence_balance_loss_weight=0.0001)
    else:
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if experts is None:
            raise ConversionError("config.json: neither 'num_experts' nor 'num_local_experts' is "
                                  "set; add the number of routed experts")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        attention.update(kind="gqa", num_kv_heads=hf.get("num_key_value_heads") or heads,
                         head_dim=head_dim, qk_norm=family == "qwen3_moe")
        moe = dict(num_experts=experts, experts_per_token=need("num_experts_per_tok"),
                   router="softmax", z_loss_weight=0.0,
                   aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.001)))
        if family == "mixtral":
            moe.update(expert_mlp_size=need("intermediate_size"), normalize_top_k=True)
        else:
            moe.update(expert_mlp_size=need("moe_intermediate_size"),
                       normalize_top_k=bool(hf.get("norm_topk_prob", False)))
            model.update(moe_layer_step=hf.get("decoder_sparse_step") or 1,
                         dense_layer_indices=list(hf.get("mlp_only_layers") or []))
    base = base or Config()
    return dataclasses.replace(
        base, model=dataclasses.replace(base.model, **model),
        attention=dataclasses.replace(AttentionConfig(), **attention),
        moe=dataclasses.replace(MoEConfig(), **moe))


def family_for(cfg: Config) -> str:
    """The HF family that can express this maxmoe config, or a ConversionError saying why not."""
    m, a, e = cfg.model, cfg.attention, cfg.moe
    if a.kind == "mla":
        if e.router != "sigmoid" or m.moe_layer_step != 1 or m.dense_layer_indices:
            raise ConversionError("to-hf: an mla model maps to deepseek_v3, which needs "
                                  "moe.router=sigmoid and dense layers only as the first k")
        return "deepseek_v3"
    if e.router != "softmax" or e.num_groups != 1 or e.num_shared_experts or e.routed_scaling_factor != 1:
        raise ConversionError("to-hf: a gqa model maps to mixtral or qwen3_moe, which need "
                              "softmax routing without groups, shared experts or scaling")
    if m.mtp_depth:
        raise ConversionError("to-hf: only deepseek_v3 holds MTP layers; set model.mtp_depth=0")
    if a.qk_norm:
        return "qwen3_moe"
    if not e.normalize_top_k or m.num_dense_layers or m.dense_layer_indices or m.moe_layer_step != 1:
        raise ConversionError("to-hf: a gqa model without qk_norm maps to mixtral, which always "
                              "renormalises and has no dense layers")
    return "mixtral"


def config_to_hf(cfg: Config, base: dict | None, dtype: str) -> dict:
    """config.json for cfg; fields of `base` (the source config.json) that maxmoe does not model
    (token ids, max positions, ...) are kept."""
    family = family_for(cfg)
    m, a, e = cfg.model, cfg.attention, cfg.moe
    hf = dict(base or {})
    for stale in ("rope_scaling", "rope_theta", "quantization_config", "torch_dtype",
                  "num_experts", "num_local_experts", "n_routed_experts"):
        hf.pop(stale, None)
    architectures = {"deepseek_v3": "DeepseekV3ForCausalLM", "mixtral": "MixtralForCausalLM",
                     "qwen3_moe": "Qwen3MoeForCausalLM"}
    rope: dict = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.rope_scaling == "yarn":
        rope.update(rope_type="yarn", factor=a.rope_factor, beta_fast=a.rope_beta_fast,
                    beta_slow=a.rope_beta_slow,
                    original_max_position_embeddings=a.rope_original_max_positions)
        if not a.rope_truncate:
            rope["truncate"] = False
        if a.rope_mscale:
            rope["mscale"] = a.rope_mscale
        if a.rope_mscale_all_dim:
            rope["mscale_all_dim"] = a.rope_mscale_all_dim
    hf.update(model_type=family, architectures=[architectures[family]], dtype=dtype,
              vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
              intermediate_size=m.dense_mlp_size, rms_norm_eps=m.rms_norm_eps,
              num_attention_heads=a.num_heads, num_experts_per_tok=e.experts_per_token,
              rope_parameters=rope, tie_word_embeddings=False, hidden_act="silu",
              attention_bias=False)
    hf.setdefault("max_position_embeddings", 4096)
    if family == "deepseek_v3":
        hf.update(num_key_value_heads=a.num_heads, q_lora_rank=a.q_lora_rank or None,
                  kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
                  qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
                  head_dim=a.qk_rope_head_dim, rope_interleave=a.rope_interleave,
                  n_routed_experts=e.num_experts, moe_intermediate_size=e.expert_mlp_size,
                  n_shared_experts=e.num_shared_experts, norm_topk_prob=e.normalize_top_k,
                  n_group=e.num_groups, topk_group=e.groups_per_token,
                  routed_scaling_factor=e.routed_scaling_factor,
                  first_k_dense_replace=m.num_dense_layers, num_nextn_predict_layers=m.mtp_depth)
    else:
        hf.update(num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim,
                  num_local_experts=e.num_experts)
        if family == "mixtral":
            hf["intermediate_size"] = e.expert_mlp_size
        else:
            hf.update(moe_intermediate_size=e.expert_mlp_size, norm_topk_prob=e.normalize_top_k,
                      decoder_sparse_step=m.moe_layer_step, mlp_only_layers=list(m.dense_layer_indices))
    return hf
