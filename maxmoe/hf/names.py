"""The tensor map: every Hugging Face hub tensor of a model <-> slices of maxmoe params.

A maxmoe param lives in the pure param dict at `path` (layers of one kind are stacked, experts
too), so a hub tensor maps to `param[index]`. Linear hub weights are [out, in] and maxmoe kernels
[in, ...out]; a hub weight may hold several maxmoe kernels as row ranges of `groups` blocks
(kv_a_proj_with_mqa = latent | rope key; kv_b_proj = per head k_nope | v). All maps are pure
permutations, so HF -> maxmoe -> HF is bit-identical.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from maxmoe.config import Config
from maxmoe.model.spec import layer_groups

Path_ = tuple  # keys into the pure param dict (str, or int for nnx.List entries)


@dataclasses.dataclass(frozen=True)
class Part:
    path: Path_
    index: tuple[int, ...] = ()  # into the stacked param: (layer,) or (layer, expert)
    rows: tuple[int, int] | None = None  # row range inside each of the `groups` row blocks
    groups: int = 1
    in_dims: int = 1  # leading kernel dims that form the hub weight's input (o_proj: heads, dims)


@dataclasses.dataclass(frozen=True)
class HubTensor:
    name: str
    linear: bool  # [out, in] weight (kernels are its transpose); False = copied as is
    parts: tuple[Part, ...]


def _linear(name, *parts: Part) -> HubTensor:
    return HubTensor(name, True, parts)


def _copy(name, path, index=()) -> HubTensor:
    return HubTensor(name, False, (Part(path, index),))


def _mlp(prefix: str, path: Path_, index: tuple, names=("gate_proj", "up_proj", "down_proj")):
    return [_linear(f"{prefix}.{hub}.weight", Part(path + (ours,), index))
            for hub, ours in zip(names, ("gate", "up", "down"), strict=True)]


def _attention(prefix: str, path: Path_, index: tuple, cfg: Config) -> list[HubTensor]:
    a = cfg.attention
    at = lambda *k: path + ("attn",) + k  # noqa: E731
    if a.kind == "gqa":
        out = [_linear(f"{prefix}.{p}_proj.weight", Part(at(p), index)) for p in "qkv"]
        out.append(_linear(f"{prefix}.o_proj.weight", Part(at("o"), index, in_dims=2)))
        if a.qk_norm:
            out += [_copy(f"{prefix}.{p}_norm.weight", at(f"{p}_norm", "scale"), index) for p in "qk"]
        return out
    c, r, nope, v = a.kv_lora_rank, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim
    if a.q_lora_rank:
        out = [_linear(f"{prefix}.q_a_proj.weight", Part(at("q_a"), index)),
               _copy(f"{prefix}.q_a_layernorm.weight", at("q_a_norm", "scale"), index),
               _linear(f"{prefix}.q_b_proj.weight", Part(at("q_b"), index))]
    else:
        out = [_linear(f"{prefix}.q_proj.weight", Part(at("q"), index))]
    return out + [
        _linear(f"{prefix}.kv_a_proj_with_mqa.weight", Part(at("kv_a"), index, (0, c)),
                Part(at("k_rope"), index, (c, c + r))),
        _copy(f"{prefix}.kv_a_layernorm.weight", at("kv_a_norm", "scale"), index),
        _linear(f"{prefix}.kv_b_proj.weight", Part(at("k_nope"), index, (0, nope), a.num_heads),
                Part(at("v"), index, (nope, nope + v), a.num_heads)),
        _linear(f"{prefix}.o_proj.weight", Part(at("o"), index, in_dims=2)),
    ]


def _block(prefix: str, path: Path_, index: tuple, is_moe: bool, cfg: Config, family: str):
    out = [_copy(f"{prefix}.input_layernorm.weight", path + ("attn_norm", "scale"), index),
           _copy(f"{prefix}.post_attention_layernorm.weight", path + ("mlp_norm", "scale"), index)]
    out += _attention(f"{prefix}.self_attn", path, index, cfg)
    mlp = path + ("mlp",)
    if not is_moe:
        return out + _mlp(f"{prefix}.mlp", mlp, index)
    moe = f"{prefix}.block_sparse_moe" if family == "mixtral" else f"{prefix}.mlp"
    out.append(_linear(f"{moe}.gate.weight", Part(mlp + ("router",), index)))
    if cfg.moe.router == "sigmoid":  # DeepSeek-V3 (V2, softmax: same names, no bias)
        out.append(_copy(f"{moe}.gate.e_score_correction_bias", mlp + ("bias",), index))
    expert_names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for e in range(cfg.moe.num_experts):
        out += _mlp(f"{moe}.experts.{e}", mlp, index + (e,), expert_names)
    if cfg.moe.num_shared_experts:
        out += _mlp(f"{moe}.shared_experts", mlp + ("shared",), index)
    return out


def hub_tensors(cfg: Config, family: str) -> list[HubTensor]:
    """Every hub tensor of the model described by cfg, in hub order (layer by layer)."""
    out = [_copy("model.embed_tokens.weight", ("embed", "embedding"))]
    groups = layer_groups(cfg.model)
    for g, (is_moe, first, count) in enumerate(groups):
        for j in range(count):
            path, index = ((("layer_groups", g), (j,)) if cfg.model.scan_layers  # stacked
                           else (("layer_groups", g, j), ()))  # per-layer params
            out += _block(f"model.layers.{first + j}", path, index, is_moe, cfg, family)
    for k in range(cfg.model.mtp_depth):  # hub index: after the trunk (DeepSeek-V3: layer 61)
        prefix, path = f"model.layers.{cfg.model.num_layers + k}", ("mtp", k)
        out += [_copy(f"{prefix}.enorm.weight", path + ("embed_norm", "scale")),
                _copy(f"{prefix}.hnorm.weight", path + ("hidden_norm", "scale")),
                _linear(f"{prefix}.eh_proj.weight", Part(path + ("projection",))),
                _copy(f"{prefix}.shared_head.norm.weight", path + ("final_norm", "scale"))]
        out += _block(prefix, path + ("block",), (), groups[-1][0], cfg, family)
    return out + [_copy("model.norm.weight", ("final_norm", "scale")),
                  _linear("lm_head.weight", Part(("lm_head",)))]


def mtp_shared_copies(cfg: Config) -> list[HubTensor]:
    """Hub MTP layers repeat the embedding and LM head; maxmoe shares the main ones."""
    out = []
    for k in range(cfg.model.mtp_depth):
        prefix = f"model.layers.{cfg.model.num_layers + k}"
        out += [_copy(f"{prefix}.embed_tokens.weight", ("embed", "embedding")),
                _linear(f"{prefix}.shared_head.head.weight", Part(("lm_head",)))]
    return out


def leaf_paths(tree) -> list[tuple[Path_, object]]:
    """(path as pure-dict keys, leaf) of every leaf of a param tree, in tree order (a list
    entry's key is its index)."""
    return [(tuple(k.key if hasattr(k, "key") else k.idx for k in path), leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def path_key(path: Path_) -> tuple[str, ...]:
    """A param path as strings, so paths compare whatever their source: nnx.List entries are
    ints in the pure dict, "0" in checkpoint metadata."""
    return tuple(str(k) for k in path)


def get_path(tree: dict, path: Path_):
    for key in path:
        tree = tree[key]
    return tree


def hub_to_params(tensor: HubTensor, value: np.ndarray, params: dict) -> None:
    """Writes the hub tensor `value` into its slices of `params` (numpy arrays, in place)."""
    for part in tensor.parts:
        target = get_path(params, part.path)
        shape = target[part.index].shape
        if not tensor.linear:
            target[part.index] = value.reshape(shape)
            continue
        rows = value.reshape(part.groups, value.shape[0] // part.groups, value.shape[1])
        if part.rows is not None:
            rows = rows[:, part.rows[0]:part.rows[1]]
        target[part.index] = rows.transpose(2, 0, 1).reshape(shape)


def params_to_hub(tensor: HubTensor, params: dict) -> np.ndarray:
    """The hub tensor assembled from its slices of `params` (the inverse of hub_to_params)."""
    if not tensor.linear:
        part = tensor.parts[0]
        return np.asarray(get_path(params, part.path)[part.index])
    blocks = []
    for part in tensor.parts:
        kernel = np.asarray(get_path(params, part.path)[part.index])
        fan_in = int(np.prod(kernel.shape[:part.in_dims]))
        blocks.append(kernel.reshape(fan_in, part.groups, -1).transpose(1, 2, 0))
    out = np.concatenate(blocks, axis=1)  # [groups, rows per group, in]
    return out.reshape(-1, out.shape[-1])


def hub_shape(tensor: HubTensor, shapes: dict) -> tuple[int, ...]:
    """The on-disk shape of a hub tensor, from the param shapes (ShapeDtypeStructs)."""
    part = tensor.parts[0]
    shape = get_path(shapes, part.path).shape[len(part.index):]
    if not tensor.linear:
        return tuple(shape)
    fan_in = int(np.prod(shape[:part.in_dims]))
    out = sum(int(np.prod(get_path(shapes, p.path).shape[len(p.index) + p.in_dims:]))
              for p in tensor.parts)
    return (out, fan_in)
