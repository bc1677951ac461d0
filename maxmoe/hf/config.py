"""Hugging Face config.json <-> maxmoe model / attention / moe sections.

Families: deepseek_v3 (MLA, sigmoid group-limited routing, shared experts, first-k dense),
deepseek_v2 (the same MLA and layout, softmax routing: greedy or group-limited by each group's
best score), mixtral (GQA, softmax top-k), qwen3_moe (GQA with q/k norm, softmax top-k, dense
layers by decoder_sparse_step / mlp_only_layers). Both RoPE styles are read: transformers 5
`rope_parameters` (with rope_theta inside) and the older `rope_scaling` + top-level `rope_theta`.

deepseek_v2 follows transformers' DeepseekV2ForCausalLM (modeling_deepseek_v2.py, 5.24), which
is the reference the parity tests hold us to; it departs from DeepSeek's own hub code in two
fields, so those are read as transformers reads them: `norm_topk_prob` is ignored (the top-k
softmax weights are never renormalised, always times `routed_scaling_factor`; DeepSeek's code
renormalises *instead of* scaling when it is true; every published V2 has it false, where both
agree), and `moe_layer_freq` is ignored (DeepSeek's code makes layer i MoE only if
i % moe_layer_freq == 0; published V2s have 1, anything else is refused). RoPE is always on
interleaved pairs (the complex form, `apply_rotary_emb`); there is no `rope_interleave` key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxmoe.config import AttentionConfig, Config, MoEConfig
from maxmoe.hf.safetensors_io import ConversionError

FAMILIES = ("deepseek_v3", "deepseek_v2", "mixtral", "qwen3_moe")
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


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


def _deepseek_v2_moe(hf: dict, need) -> dict:
    """MoEConfig fields of a deepseek_v2 config.json (DeepseekV2TopkRouter / DeepseekV2Moe)."""
    if hf.get("scoring_func", "softmax") != "softmax":
        raise ConversionError(f"config.json: deepseek_v2 with scoring_func {hf['scoring_func']!r} "
                              "is not supported; transformers' DeepSeek-V2 scores with softmax")
    method = hf.get("topk_method") or "greedy"
    if method not in V2_TOPK_METHODS:
        raise ConversionError(f"config.json: deepseek_v2 topk_method {method!r} is not supported; "
                              f"use one of {', '.join(V2_TOPK_METHODS)}")
    if (hf.get("moe_layer_freq") or 1) != 1:
        raise ConversionError(f"config.json: moe_layer_freq={hf['moe_layer_freq']} is not supported; "
                              "transformers ignores it (every layer from first_k_dense_replace on "
                              "is MoE) while DeepSeek's code does not, so only 1 is unambiguous")
    groups, groups_per_token = 1, 1  # greedy ignores n_group / topk_group
    if method == "group_limited_greedy":
        groups, groups_per_token = need("n_group"), need("topk_group")
    alpha = float(hf.get("aux_loss_alpha", 0.001))
    sequence_level = bool(hf.get("seq_aux", True))  # DeepSeek's code: per-sequence balance loss
    return dict(num_experts=need("n_routed_experts"), experts_per_token=need("num_experts_per_tok"),
                expert_mlp_size=need("moe_intermediate_size"),
                num_shared_experts=hf.get("n_shared_experts") or 0,
                # transformers ignores norm_topk_prob: the K softmax weights are never renormalised
                normalize_top_k=False, router="softmax", num_groups=groups,
                groups_per_token=groups_per_token,
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                z_loss_weight=0.0, aux_loss_weight=0.0 if sequence_level else alpha,
                sequence_balance_loss_weight=alpha if sequence_level else 0.0)


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
    if hf.get("mlp_bias"):
        raise ConversionError("config.json: mlp_bias=true is not supported")
    need = lambda key: _need(hf, key, family)  # noqa: E731
    heads = need("num_attention_heads")
    model = dict(vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
                 num_layers=need("num_hidden_layers"), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                 dense_mlp_size=need("intermediate_size"), num_dense_layers=0, mtp_depth=mtp_depth)
    attention = dict(num_heads=heads, **_rope(hf, family))
    if family in ("deepseek_v3", "deepseek_v2"):
        if hf.get("num_key_value_heads") not in (None, heads):
            raise ConversionError(f"config.json: num_key_value_heads={hf['num_key_value_heads']} "
                                  f"!= num_attention_heads={heads}; MLA has one key per query head")
        model.update(num_dense_layers=hf.get("first_k_dense_replace") or 0)
        # V2 has no rope_interleave key: it always rotates complex pairs (2i, 2i+1)
        interleave = family == "deepseek_v2" or bool(hf.get("rope_interleave", True))
        attention.update(kind="mla", num_kv_heads=heads, q_lora_rank=hf.get("q_lora_rank") or 0,
                         kv_lora_rank=need("kv_lora_rank"), qk_nope_head_dim=need("qk_nope_head_dim"),
                         qk_rope_head_dim=need("qk_rope_head_dim"), v_head_dim=need("v_head_dim"),
                         rope_interleave=interleave)
    if family == "deepseek_v2":
        moe = _deepseek_v2_moe(hf, need)
    elif family == "deepseek_v3":
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConversionError("config.json: deepseek_v3 with scoring_func other than sigmoid "
                                  "is not supported")
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
        if m.moe_layer_step != 1 or m.dense_layer_indices:
            raise ConversionError("to-hf: an mla model maps to deepseek_v3 or deepseek_v2, which "
                                  "have dense layers only as the first k")
        if e.router == "sigmoid":
            return "deepseek_v3"
        if m.mtp_depth:
            raise ConversionError("to-hf: only deepseek_v3 holds MTP layers; set model.mtp_depth=0 "
                                  "or moe.router=sigmoid")
        if e.normalize_top_k or not a.rope_interleave:
            raise ConversionError("to-hf: an mla model with softmax routing maps to deepseek_v2, "
                                  "which never renormalises the top-k weights and rotates "
                                  "interleaved pairs; set moe.normalize_top_k=false and "
                                  "attention.rope_interleave=true")
        if m.hidden_size % a.num_heads:
            raise ConversionError("to-hf: transformers' deepseek_v2 config needs hidden_size to be "
                                  "a multiple of num_attention_heads")
        return "deepseek_v2"
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
    architectures = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                     "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
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
    if family in ("deepseek_v3", "deepseek_v2"):
        hf.update(num_key_value_heads=a.num_heads, q_lora_rank=a.q_lora_rank or None,
                  kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim,
                  qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
                  head_dim=a.qk_rope_head_dim, n_routed_experts=e.num_experts,
                  moe_intermediate_size=e.expert_mlp_size, n_shared_experts=e.num_shared_experts,
                  norm_topk_prob=e.normalize_top_k, n_group=e.num_groups,
                  topk_group=e.groups_per_token, routed_scaling_factor=e.routed_scaling_factor,
                  first_k_dense_replace=m.num_dense_layers)
    if family == "deepseek_v3":
        hf.update(rope_interleave=a.rope_interleave, num_nextn_predict_layers=m.mtp_depth)
    elif family == "deepseek_v2":
        for other in ("rope_interleave", "num_nextn_predict_layers"):
            hf.pop(other, None)
        # scoring_func and moe_layer_freq are read by DeepSeek's own code only; with them (and
        # norm_topk_prob false, which family_for requires) both codes compute the same
        hf.update(topk_method="group_limited_greedy" if e.num_groups > 1 else "greedy",
                  scoring_func="softmax", moe_layer_freq=1)
    elif family in ("mixtral", "qwen3_moe"):
        hf.update(num_key_value_heads=a.num_kv_heads, head_dim=a.head_dim,
                  num_local_experts=e.num_experts)
        if family == "mixtral":
            hf["intermediate_size"] = e.expert_mlp_size
        else:
            hf.update(moe_intermediate_size=e.expert_mlp_size, norm_topk_prob=e.normalize_top_k,
                      decoder_sparse_step=m.moe_layer_step, mlp_only_layers=list(m.dense_layer_indices))
    return hf
