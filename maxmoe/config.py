"""Typed, frozen configuration: one dataclass per concern, YAML presets + dotted overrides.

`load_config(["a.yaml", "b.yaml"], ["train.steps=10"])` merges the files in order, then the
overrides, checks every key and type, and returns a `Config`. Every error is a `ConfigError`
whose one-line message names the key, the value, where it came from and how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A user mistake in the configuration; the CLI prints it as one line and exits 2."""


@dataclass(frozen=True)
class RunConfig:
    dir: str = ""  # run directory; empty = runs/<name of the last config file>
    name: str = ""  # run name used in logs; empty = derived from the config file


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048  # must equal the tokenizer's vocabulary size
    hidden_size: int = 128  # D
    num_layers: int = 4  # all decoder blocks, dense and MoE
    num_dense_layers: int = 1  # the first layers use a dense SwiGLU MLP (DeepSeek first_k_dense)
    dense_mlp_size: int = 512  # hidden width of the dense SwiGLU MLP
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02  # normal init std of every kernel and the embedding
    scan_layers: bool = True  # stack layers and run them with lax.scan (flat compile time)
    # none | full | dots (save matmul outputs) | save_named (save the qkv projections, attention
    # output, MoE dispatch/combine) | offload_named (those, offloaded to pinned host memory)
    remat_policy: str = "full"
    moe_layer_step: int = 1  # layer i is MoE only if (i + 1) % step == 0 (Qwen3 decoder_sparse_step)
    dense_layer_indices: list[int] = field(default_factory=list)  # also dense (Qwen3 mlp_only_layers)
    mtp_depth: int = 0  # multi-token prediction depths D after the trunk (DeepSeek-V3: 1); 0 = off
    mtp_loss_weight: float = 0.3  # lambda: the loss adds lambda / D * sum of the D depth losses
    pipeline_schedule: str = "gpipe"  # gpipe | circular (V repeats per stage, microbatches = stages)
    pipeline_microbatches: int = 0  # gpipe microbatches per step; 0 = number of stages
    pipeline_repeats: int = 2  # circular: layer chunks per stage (bubble shrinks V times)


@dataclass(frozen=True)
class AttentionConfig:
    num_heads: int = 4  # H query heads
    num_kv_heads: int = 2  # grouped-query attention: H must be a multiple of this
    head_dim: int = 32  # gqa only; mla head sizes are the qk_*/v_head_dim fields
    rope_theta: float = 10000.0
    kind: str = "gqa"  # gqa (Mixtral, Qwen3) | mla (DeepSeek multi-head latent attention)
    implementation: str = "einsum"  # gqa: einsum (XLA) | fused (jax.nn.dot_product_attention: cuDNN flash on GPU)
    qk_norm: bool = False  # gqa: RMSNorm over head_dim of every q and k head before RoPE (Qwen3)
    q_lora_rank: int = 0  # mla: rank of the low-rank query path; 0 = one full-rank q projection
    kv_lora_rank: int = 512  # mla: width of the compressed key/value latent
    qk_nope_head_dim: int = 128  # mla: per-head query/key dims without RoPE
    qk_rope_head_dim: int = 64  # mla: per-head query dims with RoPE (one RoPE key head is shared)
    v_head_dim: int = 128  # mla: per-head value dims
    rope_interleave: bool = False  # rotate pairs (2i, 2i+1), not (i, i + d/2) (DeepSeek hub weights)
    rope_scaling: str = "none"  # none | yarn (context extension)
    rope_factor: float = 1.0  # yarn: context extension factor
    rope_original_max_positions: int = 4096  # yarn: pretraining context length
    rope_beta_fast: float = 32.0  # yarn: rotations above which frequencies are kept
    rope_beta_slow: float = 1.0  # yarn: rotations below which frequencies are interpolated
    rope_truncate: bool = True  # yarn: floor/ceil the correction range (HF default)
    rope_mscale: float = 0.0  # yarn: cos/sin scale mscale(factor, this)/mscale(factor, all_dim); 0 = unset
    rope_mscale_all_dim: float = 0.0  # yarn: as above; mla also scales softmax by mscale(factor, this)^2


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 8  # E routed experts
    experts_per_token: int = 2  # K (top-k)
    expert_mlp_size: int = 256  # F, hidden width of each routed expert
    num_shared_experts: int = 0  # experts every token goes through (width F each)
    normalize_top_k: bool = True  # renormalise the K router weights to sum to 1 (Mixtral)
    aux_loss_weight: float = 0.01  # Switch/GShard load-balancing loss weight
    z_loss_weight: float = 0.001  # router z-loss weight (ST-MoE)
    dispatch: str = "dropless"  # dropless (sort + grouped matmul) | capacity (slots, may drop)
    capacity_factor: float = 1.25  # capacity: slots per expert = factor * local tokens * K / E
    drop_policy: str = "position"  # capacity: drop overflow by position | probability (lowest)
    grouped_matmul: str = "auto"  # dropless: ragged_dot | blocked | auto (blocked on CPU)
    block_size: int = 0  # dropless blocked: rows per block (experts padded to whole blocks); 0 = auto
    router: str = "softmax"  # softmax (Mixtral, Qwen3) | sigmoid (DeepSeek-V3, with a selection bias)
    num_groups: int = 1  # experts form this many contiguous groups (DeepSeek n_group)
    groups_per_token: int = 1  # a token picks experts from its best groups only (DeepSeek topk_group)
    routed_scaling_factor: float = 1.0  # multiplies the routed weights (DeepSeek-V3: 2.5)
    bias_update_speed: float = 0.0  # aux-loss-free balancing: bias += speed * sign(mean - load) per step
    sequence_balance_loss_weight: float = 0.0  # alpha of DeepSeek-V3's per-sequence balance loss


MESH_AXES = ("data", "fsdp", "pipeline", "expert", "tensor")
REMAT_POLICY_NAMES = ("none", "full", "dots", "save_named", "offload_named")

# logical axis -> mesh axes. Params: embed, mlp, heads, kv_heads, vocab, experts, expert_mlp,
# layers. Activations: batch, seq, act_embed, act_heads, act_mlp, act_vocab.
DEFAULT_RULES: dict[str, list[str]] = {
    "batch": ["data", "fsdp", "expert"],
    "seq": [],
    "act_embed": [],
    "act_heads": ["tensor"],
    "act_mlp": ["tensor"],
    "act_vocab": ["tensor"],
    "embed": ["fsdp"],
    "mlp": ["tensor"],
    "heads": ["tensor"],
    "kv_heads": ["tensor"],
    "head_dim": [],
    "vocab": ["tensor"],
    "experts": ["expert"],
    "expert_mlp": ["tensor"],
    "layers": ["pipeline"],  # stacked layer dim; kept whole where stages do not divide it
    "stage": ["pipeline"],
    "q_lora": [],
    "kv_lora": [],
}


@dataclass(frozen=True)
class MeshConfig:
    data: int = -1  # pure data-parallel replicas; -1 = whatever the other axes leave
    fsdp: int = 1  # ZeRO-3 sharding of params, grads and optimizer state
    pipeline: int = 1  # pipeline stages (layer groups split into stages, see model.pipeline_*)
    expert: int = 1  # routed experts are split over this axis
    tensor: int = 1  # Megatron-style heads / MLP / vocab split
    # of each axis above, the factor that spans hosts (DCN); the rest stays inside a host (ICI,
    # NVLink), so fast axes never cross the slow network. Product = number of hosts.
    dcn_data: int = 1
    dcn_fsdp: int = 1
    dcn_pipeline: int = 1
    dcn_expert: int = 1
    dcn_tensor: int = 1
    cpu_devices: int = 0  # fake this many CPU devices when running on CPU (0 = leave as is)
    rules: dict[str, list[str]] = field(
        default_factory=lambda: {k: list(v) for k, v in DEFAULT_RULES.items()})


@dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 3e-3  # peak learning rate
    warmup_steps: int = 20  # linear warmup from 0
    decay_steps: int = 0  # cosine decay length after warmup; 0 = until train.steps
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled (AdamW); not applied to norms
    grad_clip_norm: float = 1.0  # global-norm clipping (the start norm of a schedule); 0 = off
    grad_clip_end_norm: float = 0.0  # > 0: clip norm decays linearly to this; 0 = constant
    grad_clip_decay_steps: int = 0  # length of that linear decay; 0 = until train.steps
    moment_dtype: str = "float32"  # adam first moment: float32 | bfloat16 (second stays float32)
    offload_state: bool = False  # keep optimizer state in pinned host memory (ZeRO-offload)


@dataclass(frozen=True)
class PrecisionConfig:
    compute_dtype: str = "bfloat16"  # bfloat16 | float16 | float32 (params stay float32)
    loss_scaling: str = "auto"  # dynamic | none | auto (dynamic for float16 only)
    loss_scale_initial_power: int = 16  # dynamic: initial scale 2^this (DeepSpeed initial_scale_power)
    loss_scale_window: int = 1000  # dynamic: double the scale after this many clean steps
    loss_scale_hysteresis: int = 2  # dynamic: overflows tolerated before halving (DeepSpeed)
    loss_scale_min: float = 1.0  # dynamic: an overflow at this scale stops the run


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # 'stdlib' (this interpreter's Python sources), a glob of text files
    # or a folder written by `maxmoe data prepare`
    tokenizer_dir: str = ""  # trained SentencePiece model dir; empty = cache under ~/.cache/maxmoe
    seq_len: int = 128  # S, tokens per packed row
    global_batch_size: int = 16  # B, rows per optimizer step across all processes
    seed: int = 0  # shuffling seed
    num_workers: int = 0  # grain worker processes (0 = in the main process)
    streams: int = 16  # train rows interleave this many packed document streams (1 = one stream)
    prefetch_batches: int = 4  # batches each worker process keeps ready ahead of the step
    validation_fraction: float = 0.02  # documents held out for evaluation (raw sources only)
    # weighted prepared datasets 'DIR:WEIGHT,DIR:WEIGHT' (weights = token shares); empty =
    # `source` alone. `source` may itself be a folder written by `maxmoe data prepare`.
    mixture: str = ""

    def mixture_weights(self) -> dict[str, float]:
        """{dataset: weight}, weights summing to 1; {source: 1.0} without a mixture."""
        if not self.mixture.strip():
            return {self.source: 1.0}
        weights: dict[str, float] = {}
        for item in self.mixture.split(","):
            path, colon, weight = item.strip().rpartition(":")
            try:
                value = float(weight)
            except ValueError:
                value = -1.0
            if not colon or not path or not value > 0 or path in weights:
                raise ValueError(f"entry {item.strip()!r} is not DIR:WEIGHT with a new DIR "
                                 "and a weight > 0")
            weights[path] = value
        total = sum(weights.values())
        return {path: value / total for path, value in weights.items()}


@dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool = True
    every_steps: int = 50  # also saved at the last step
    keep: int = 3  # newest checkpoints kept on disk (the latest is never deleted)
    keep_best: int = 0  # also keep this many lowest-eval-loss steps (needs train.eval_every_steps)
    async_save: bool = True


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200  # optimizer steps
    grad_accum_steps: int = 1  # microbatches per optimizer step (global batch is split)
    seed: int = 0  # parameter init seed
    eval_every_steps: int = 0  # validation loss every N steps (ranks checkpoint.keep_best); 0 = off
    eval_batches: int = 4  # validation batches per evaluation


@dataclass(frozen=True)
class GuardConfig:
    max_consecutive_skips: int = 50  # stop after this many skipped updates in a row (0 = never)
    grad_norm_ceiling: float = 1e3  # stop when the finite global grad norm exceeds this (0 = off)
    spike_action: str = "skip"  # on a loss/grad-norm spike: none | skip (the update) | rollback
    spike_window: int = 100  # spikes are judged against this many recent applied steps
    spike_zscore: float = 6.0  # a step is a spike if loss or grad norm z-score exceeds this
    rollback_extra_batches: int = 0  # rollback: skip this many more batches after the spike
    max_rollbacks: int = 5  # stop if more rollbacks than this are needed in one run
    activation_rms_warn: float = 100.0  # warn when a layer's residual RMS exceeds this
    update_ratio_warn: float = 0.1  # warn when a layer's |update| / |param| exceeds this


@dataclass(frozen=True)
class LoggingConfig:
    every_steps: int = 10  # metrics.jsonl / progress bar update period
    progress_bar: bool = True
    peak_flops_per_device: float = 0.0  # for MFU; 0 = known GPU table, or measured on CPU


@dataclass(frozen=True)
class DistributedConfig:
    # Process identity: explicit here or in MAXMOE_COORDINATOR / MAXMOE_NUM_PROCESSES /
    # MAXMOE_PROCESS_ID, else detected from SLURM, Open MPI or Kubernetes (maxmoe/distributed.py).
    coordinator_address: str = ""  # host:port of process 0; empty = from the environment
    num_processes: int = 0  # processes (one per host); 0 = from the environment
    process_id: int = -1  # this process's index; -1 = from the environment
    initialization_timeout_s: int = 300  # how long processes wait for each other at start-up
    heartbeat_timeout_s: int = 100  # a process silent this long is dead: the others abort
    shutdown_timeout_s: int = 120  # how long an exiting process waits for the others


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


# --------------------------------------------------------------------------- loading


def _fail(key: str, value: Any, origin: str, problem: str, fix: str) -> typing.NoReturn:
    raise ConfigError(f"config key '{key}' = {value!r} (from {origin}): {problem}; {fix}")


def _merge(dst: dict, src: dict, origins: dict[str, str], origin: str, prefix: str = "") -> None:
    for k, v in src.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):  # recurse so every leaf key records where it came from
            if not isinstance(dst.get(k), dict):
                dst[k] = {}
            origins.setdefault(key, origin)
            _merge(dst[k], v, origins, origin, key + ".")
        else:
            dst[k] = v
            origins[key] = origin


def _check_type(key: str, value: Any, tp: Any, origin: str) -> Any:
    """Returns value converted to tp where that is lossless (int -> float), else fails."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            _fail(key, value, origin, f"expected {tp.__name__}, got {type(value).__name__}",
                  f"write a value of type {tp.__name__}")
        return value
    if typing.get_origin(tp) is list:
        if not isinstance(value, list) or not all(type(v) is int for v in value):
            _fail(key, value, origin, "expected a list of integers", "write e.g. [0, 5]")
        return list(value)
    if typing.get_origin(tp) is dict:
        if not isinstance(value, dict) or not all(
                isinstance(v, list) and all(isinstance(a, str) for a in v) for v in value.values()):
            _fail(key, value, origin, "expected a mapping of logical axis -> list of mesh axes",
                  "write e.g. {batch: [data, fsdp]}")
        # a rules mapping overrides the default table per logical axis
        return {**{k: list(v) for k, v in DEFAULT_RULES.items()},
                **{k: list(v) for k, v in value.items()}}
    raise TypeError(f"unsupported config field type {tp} at {key}")  # a bug, not a user error


def _build(cls: type, raw: dict, origins: dict[str, str], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in raw:
        if k not in names:
            key = f"{prefix}{k}"
            _fail(key, raw[k], origins.get(key, "?"), "unknown key",
                  f"valid keys under '{prefix[:-1] or 'top level'}' are: {', '.join(sorted(names))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        key, tp = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(raw[f.name], dict):
                _fail(key, raw[f.name], origins.get(key, "?"), "expected a section (mapping)",
                      f"nest its keys under '{key}:'")
            kwargs[f.name] = _build(tp, raw[f.name], origins, key + ".")
        else:
            kwargs[f.name] = _check_type(key, raw[f.name], tp, origins.get(key, "?"))
    return cls(**kwargs)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} (from command line): expected key.sub=value; "
                          "write e.g. train.steps=100")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def load_config(paths: list[str], overrides: list[str] = ()) -> tuple[Config, dict[str, str]]:
    """Merges YAML presets then dotted overrides. Returns the config and key -> origin."""
    raw: dict = {}
    origins: dict[str, str] = {}
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ConfigError(f"config file {p!r}: not found; pass the path of an existing YAML file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p!r}: not valid YAML ({str(e).splitlines()[0]}); "
                              "fix the syntax") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p!r}: top level must be a mapping of sections; "
                              "write e.g. 'train:\\n  steps: 100'")
        _merge(raw, data, origins, p)
    for text in overrides:
        keys, value = _parse_override(text)
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        _merge(raw, nested, origins, "command line")
    cfg = _build(Config, raw, origins)
    if not cfg.run.dir:
        name = cfg.run.name or (Path(paths[-1]).stem if paths else "default")
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(Path("runs") / name)))
    return cfg, origins


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


# --------------------------------------------------------------------------- validation


def resolve_mesh_shape(cfg: Config, num_devices: int, origins: dict[str, str]) -> dict[str, int]:
    """Mesh axis sizes with a -1 axis filled in; fails unless the product is num_devices."""
    sizes = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    for a, s in sizes.items():
        if s == 0 or s < -1:
            _fail(f"mesh.{a}", s, origins.get(f"mesh.{a}", "defaults"), "must be >= 1 or -1 (fill)",
                  "set a positive size")
    if len(free) > 1:
        _fail(f"mesh.{free[1]}", -1, origins.get(f"mesh.{free[1]}", "defaults"),
              "only one mesh axis may be -1", "give the others explicit sizes")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if num_devices % fixed:
            a = free[0]
            _fail(f"mesh.{a}", -1, origins.get(f"mesh.{a}", "defaults"),
                  f"the other axes multiply to {fixed}, which does not divide {num_devices} devices",
                  "change the axis sizes so their product divides the device count")
        sizes[free[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        shape = " x ".join(f"{a}={s}" for a, s in sizes.items())
        key = next((f"mesh.{a}" for a in MESH_AXES if f"mesh.{a}" in origins), "mesh.data")
        _fail(key, getattr(cfg.mesh, key.split(".")[1]), origins.get(key, "defaults"),
              f"mesh {shape} has {math.prod(sizes.values())} devices but {num_devices} are present",
              "make the product of the mesh axes equal the device count (or set one axis to -1)")
    return sizes


def dcn_sizes(cfg: Config) -> dict[str, int]:
    return {a: getattr(cfg.mesh, f"dcn_{a}") for a in MESH_AXES}


def validate(cfg: Config, num_devices: int, origins: dict[str, str],
             num_processes: int = 1) -> dict[str, int]:
    """Checks everything that can be checked before compiling; returns the mesh shape."""
    o = lambda k: origins.get(k, "defaults")  # noqa: E731

    def need(ok: bool, key: str, problem: str, fix: str) -> None:
        if not ok:
            section, name = key.split(".")
            _fail(key, getattr(getattr(cfg, section), name), o(key), problem, fix)

    m, a, e, d, t = cfg.model, cfg.attention, cfg.moe, cfg.data, cfg.train
    for key in ("model.vocab_size", "model.hidden_size", "model.num_layers", "model.dense_mlp_size",
                "attention.num_heads", "attention.num_kv_heads", "attention.head_dim",
                "moe.num_experts", "moe.experts_per_token", "moe.expert_mlp_size",
                "data.seq_len", "data.global_batch_size", "train.steps",
                "train.grad_accum_steps", "checkpoint.every_steps", "checkpoint.keep",
                "logging.every_steps"):
        section, name = key.split(".")
        need(getattr(getattr(cfg, section), name) >= 1, key, "must be >= 1", "use a positive value")
    need(0 <= m.num_dense_layers <= m.num_layers, "model.num_dense_layers",
         f"must be between 0 and model.num_layers ({m.num_layers})", "lower it")
    need(m.remat_policy in REMAT_POLICY_NAMES, "model.remat_policy", "unknown policy",
         f"use one of: {', '.join(REMAT_POLICY_NAMES)}")
    need(a.num_heads % a.num_kv_heads == 0, "attention.num_kv_heads",
         f"must divide attention.num_heads ({a.num_heads})", "pick a divisor of the head count")
    need(e.experts_per_token <= e.num_experts, "moe.experts_per_token",
         f"top-k cannot exceed moe.num_experts ({e.num_experts})", "lower it or add experts")
    need(e.num_shared_experts >= 0, "moe.num_shared_experts", "must be >= 0", "use 0 or more")
    need(e.dispatch in ("dropless", "capacity"), "moe.dispatch", "unknown dispatch",
         "use dropless or capacity")
    need(e.capacity_factor > 0, "moe.capacity_factor", "must be > 0", "use e.g. 1.25")
    need(e.grouped_matmul in ("auto", "ragged_dot", "blocked"), "moe.grouped_matmul",
         "unknown grouped matmul", "use auto, ragged_dot or blocked")
    need(e.block_size >= 0, "moe.block_size", "must be >= 0", "use 0 (auto) or e.g. 128")
    need(e.drop_policy in ("position", "probability"), "moe.drop_policy", "unknown policy",
         "use position or probability")
    need(m.moe_layer_step >= 1, "model.moe_layer_step", "must be >= 1", "use 1 (every layer MoE)")
    need(all(0 <= i < m.num_layers for i in m.dense_layer_indices), "model.dense_layer_indices",
         f"every index must be in [0, model.num_layers) = [0, {m.num_layers})", "drop the others")
    need(m.mtp_depth >= 0, "model.mtp_depth", "must be >= 0", "use 0 (off) or 1 (DeepSeek-V3)")
    need(a.kind in ("gqa", "mla"), "attention.kind", "unknown attention", "use gqa or mla")
    need(a.implementation in ("einsum", "fused"), "attention.implementation",
         "unknown implementation", "use einsum or fused")
    need(a.implementation == "einsum" or a.kind == "gqa", "attention.implementation",
         "the fused kernel is wired for gqa only", "use einsum with mla")
    if a.kind == "mla":
        for key in ("attention.kv_lora_rank", "attention.qk_nope_head_dim",
                    "attention.qk_rope_head_dim", "attention.v_head_dim"):
            need(getattr(a, key.split(".")[1]) >= 1, key, "must be >= 1 for mla",
                 "use a positive value")
        need(a.qk_rope_head_dim % 2 == 0, "attention.qk_rope_head_dim", "RoPE needs an even size",
             "use an even value")
        need(a.q_lora_rank >= 0, "attention.q_lora_rank", "must be >= 0", "use 0 (no low-rank q)")
    need(a.kind == "gqa" or not a.qk_norm, "attention.qk_norm", "only gqa has q/k norms",
         "set attention.qk_norm=false for mla")
    need(a.head_dim % 2 == 0, "attention.head_dim", "RoPE needs an even size", "use an even value")
    need(a.rope_scaling in ("none", "yarn"), "attention.rope_scaling", "unknown scaling",
         "use none or yarn")
    if a.rope_scaling == "yarn":
        need(a.rope_factor >= 1.0, "attention.rope_factor", "must be >= 1", "use e.g. 40")
        need(a.rope_original_max_positions >= 1, "attention.rope_original_max_positions",
             "must be >= 1", "use the pretraining context length")
        need(a.rope_beta_fast > 0 and a.rope_beta_slow > 0, "attention.rope_beta_fast",
             "yarn betas must be > 0", "use the defaults 32 and 1")
    need(e.router in ("softmax", "sigmoid"), "moe.router", "unknown router",
         "use softmax or sigmoid")
    need(e.num_groups >= 1 and e.num_experts % e.num_groups == 0, "moe.num_groups",
         f"must be >= 1 and divide moe.num_experts ({e.num_experts})", "pick a divisor")
    if e.num_groups > 1:
        need(e.num_experts // e.num_groups >= 2, "moe.num_groups",
             "groups are ranked by their top-2 scores, so each needs >= 2 experts", "use fewer groups")
    need(1 <= e.groups_per_token <= e.num_groups, "moe.groups_per_token",
         f"must be between 1 and moe.num_groups ({e.num_groups})", "lower it")
    need(e.experts_per_token <= e.groups_per_token * (e.num_experts // e.num_groups),
         "moe.experts_per_token", "more than the experts of moe.groups_per_token groups",
         "raise moe.groups_per_token or lower the top-k")
    need(e.bias_update_speed >= 0, "moe.bias_update_speed", "must be >= 0", "use 0 (off) or 0.001")
    need(e.bias_update_speed == 0 or e.router == "sigmoid", "moe.bias_update_speed",
         "the selection bias exists only with moe.router=sigmoid", "set moe.router=sigmoid or 0")
    need(cfg.precision.compute_dtype in ("bfloat16", "float16", "float32"),
         "precision.compute_dtype", "unknown dtype", "use bfloat16, float16 or float32")
    pr, g, op = cfg.precision, cfg.guard, cfg.optimizer
    need(pr.loss_scaling in ("auto", "dynamic", "none"), "precision.loss_scaling",
         "unknown loss scaling", "use auto, dynamic or none")
    need(pr.loss_scaling != "none" or pr.compute_dtype != "float16", "precision.loss_scaling",
         "float16 gradients underflow without loss scaling", "use auto or dynamic")
    need(0 <= pr.loss_scale_initial_power <= 64, "precision.loss_scale_initial_power",
         "must be in [0, 64]", "use e.g. 16 (scale 65536)")
    need(pr.loss_scale_window >= 1, "precision.loss_scale_window", "must be >= 1", "use e.g. 1000")
    need(pr.loss_scale_hysteresis >= 1, "precision.loss_scale_hysteresis", "must be >= 1",
         "use 1 (halve on every overflow) or 2 (DeepSpeed)")
    need(0 < pr.loss_scale_min <= 2.0 ** pr.loss_scale_initial_power, "precision.loss_scale_min",
         "must be > 0 and at most the initial scale", "use e.g. 1")
    need(op.moment_dtype in ("float32", "bfloat16"), "optimizer.moment_dtype", "unknown dtype",
         "use float32 or bfloat16")
    need(op.grad_clip_norm >= 0, "optimizer.grad_clip_norm", "must be >= 0", "use 0 (off) or 1.0")
    need(op.grad_clip_end_norm >= 0 and (op.grad_clip_end_norm == 0 or op.grad_clip_norm > 0),
         "optimizer.grad_clip_end_norm", "must be >= 0, and a decay needs grad_clip_norm > 0",
         "use 0 (constant) or set optimizer.grad_clip_norm")
    need(op.grad_clip_decay_steps >= 0, "optimizer.grad_clip_decay_steps", "must be >= 0",
         "use 0 (until train.steps)")
    need(g.max_consecutive_skips >= 0, "guard.max_consecutive_skips", "must be >= 0",
         "use 0 (never stop) or e.g. 50")
    need(g.grad_norm_ceiling >= 0, "guard.grad_norm_ceiling", "must be >= 0", "use 0 (off) or 1e3")
    need(g.spike_action in ("none", "skip", "rollback"), "guard.spike_action", "unknown action",
         "use none, skip or rollback")
    need(g.spike_window >= 2, "guard.spike_window", "must be >= 2", "use e.g. 100")
    need(g.spike_zscore > 0, "guard.spike_zscore", "must be > 0", "use e.g. 6")
    need(g.rollback_extra_batches >= 0, "guard.rollback_extra_batches", "must be >= 0", "use 0")
    need(g.max_rollbacks >= 0, "guard.max_rollbacks", "must be >= 0", "use e.g. 5")
    need(d.streams >= 1, "data.streams", "must be >= 1", "use 1 for a single stream")
    need(0.0 <= d.validation_fraction < 1.0, "data.validation_fraction", "must be in [0, 1)",
         "use e.g. 0.02")
    need(d.prefetch_batches >= 1, "data.prefetch_batches", "must be >= 1", "use e.g. 4")
    c, dist = cfg.checkpoint, cfg.distributed
    need(c.keep_best >= 0, "checkpoint.keep_best", "must be >= 0", "use 0 (off) or e.g. 1")
    need(c.keep_best == 0 or t.eval_every_steps > 0, "checkpoint.keep_best",
         "ranking by eval loss needs evaluations", "set train.eval_every_steps or keep_best=0")
    need(t.eval_every_steps >= 0, "train.eval_every_steps", "must be >= 0", "use 0 (off) or e.g. 50")
    need(t.eval_batches >= 1, "train.eval_batches", "must be >= 1", "use e.g. 4")
    for key in ("distributed.initialization_timeout_s", "distributed.heartbeat_timeout_s",
                "distributed.shutdown_timeout_s"):
        need(getattr(dist, key.split(".")[1]) >= 1, key, "must be >= 1 second", "use e.g. 60")
    need(dist.num_processes >= 0, "distributed.num_processes", "must be >= 0",
         "use 0 (from the environment) or the process count")
    need(dist.process_id == -1 or 0 <= dist.process_id < max(dist.num_processes, 1),
         "distributed.process_id", f"must be -1 or in [0, distributed.num_processes = "
         f"{dist.num_processes})", "use 0 .. num_processes - 1 and set num_processes")
    host, colon, port = dist.coordinator_address.rpartition(":")
    need(not dist.coordinator_address or bool(host and colon and port.isdigit()),
         "distributed.coordinator_address", "expected host:port", "write e.g. 10.0.0.1:8476")
    try:
        d.mixture_weights()
    except ValueError as error:
        need(False, "data.mixture", str(error), "write e.g. 'data/web:0.7,data/code:0.3'")

    sizes = resolve_mesh_shape(cfg, num_devices, origins)
    dcn = dcn_sizes(cfg)
    for ax, n in dcn.items():
        need(n >= 1 and sizes[ax] % n == 0, f"mesh.dcn_{ax}",
             f"must be >= 1 and divide mesh.{ax} ({sizes[ax]})", "use a divisor of the axis size")
    hosts = math.prod(dcn.values())
    need(hosts == num_processes or (num_processes == 1 and num_devices % hosts == 0),
         "mesh.dcn_data", f"the dcn factors multiply to {hosts} but there are {num_processes} "
         "processes (hosts)", "make the product of mesh.dcn_* equal the number of hosts")
    need(m.pipeline_schedule in ("gpipe", "circular"), "model.pipeline_schedule",
         "unknown schedule", "use gpipe or circular")
    need(m.pipeline_microbatches >= 0 and m.pipeline_repeats >= 1, "model.pipeline_microbatches",
         "microbatches must be >= 0 and repeats >= 1", "use e.g. 0 (= stages) and 2")
    stages = sizes["pipeline"]
    if stages > 1:
        from maxmoe.model.transformer import layer_groups  # noqa: PLC0415 (config <- model)

        repeats = m.pipeline_repeats if m.pipeline_schedule == "circular" else 1
        sizes_of_groups = [n for _, _, n in layer_groups(m)]
        need(any(n % (stages * repeats) == 0 for n in sizes_of_groups), "mesh.pipeline",
             f"no run of same-kind layers (sizes {sizes_of_groups}) divides into {stages} stages"
             f" x {repeats} repeats", "change mesh.pipeline, model.pipeline_repeats or the layers")
        micro = stages if repeats > 1 else (m.pipeline_microbatches or stages)
        per_step = d.global_batch_size // t.grad_accum_steps
        need(per_step % (micro * math.prod(sizes[ax] for ax in cfg.mesh.rules["batch"])) == 0,
             "data.global_batch_size", f"each of the {micro} pipeline microbatches needs a "
             "whole number of rows per batch shard", "use a larger multiple of the batch shards")
    rules = cfg.mesh.rules
    for logical, axes in rules.items():
        for ax in axes:
            if ax not in MESH_AXES:
                _fail(f"mesh.rules.{logical}", axes, o("mesh.rules"), f"unknown mesh axis {ax!r}",
                      f"use axes from: {', '.join(MESH_AXES)}")
    def shards(logical: str) -> int:
        return math.prod(sizes[ax] for ax in rules[logical])

    divisible = [
        ("attention.num_heads", a.num_heads, "heads"),
        ("attention.num_kv_heads", a.num_kv_heads, "kv_heads"),
        ("moe.num_experts", e.num_experts, "experts"),
        ("moe.expert_mlp_size", e.expert_mlp_size, "expert_mlp"),
        ("model.dense_mlp_size", m.dense_mlp_size, "mlp"),
        ("model.vocab_size", m.vocab_size, "vocab"),
        ("model.hidden_size", m.hidden_size, "embed"),
    ]
    for key, value, logical in divisible:
        n = shards(logical)
        need(value % n == 0, key, f"not divisible by the {n} shards of logical axis '{logical}' "
             f"(mesh axes {rules[logical]})", f"use a multiple of {n} or change the mesh")
    batch_shards = shards("batch") * t.grad_accum_steps
    need(d.global_batch_size % batch_shards == 0, "data.global_batch_size",
         f"not divisible by batch shards x grad_accum_steps ({batch_shards})",
         f"use a multiple of {batch_shards}")
    return sizes
