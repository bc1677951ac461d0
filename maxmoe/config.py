"""Typed, frozen configuration: one dataclass per concern, each field with its default and why.

config_files.py reads them from YAML presets and dotted overrides. Every config error is a
`ConfigError` whose one-line message names the key, the value, where it came from and how to
fix it (`fail`).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A user mistake in the configuration; the CLI prints it as one line and exits 2."""


@dataclass(frozen=True)
class RunConfig:
    dir: str = ""  # run directory; empty = runs/<name of the last config file>
    name: str = ""  # run name used in logs; empty = derived from the config file


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048  # at least the tokenizer's vocabulary size (may pad it)
    hidden_size: int = 128  # D
    num_layers: int = 4  # all decoder blocks, dense and MoE
    num_dense_layers: int = 1  # the first layers use a dense SwiGLU MLP (DeepSeek first_k_dense)
    dense_mlp_size: int = 512  # hidden width of the dense SwiGLU MLP
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02  # normal init std of every kernel and the embedding
    # stack layers and run them with lax.scan (flat compile time); false: per-layer params,
    # unrolled (faster for a few layers; changes the checkpoint layout)
    scan_layers: bool = True
    # none | full | dots (save matmul outputs) | save_named (save the qkv projections, attention
    # output, MoE dispatch/combine) | offload_named (those, offloaded to pinned host memory) |
    # save_received (full, but keep what two_level's hop 1 received across hosts)
    remat_policy: str = "full"
    moe_layer_step: int = 1  # layer i is MoE only if (i + 1) % step == 0 (Qwen3 decoder_sparse_step)
    dense_layer_indices: list[int] = field(default_factory=list)  # also dense (Qwen3 mlp_only_layers)
    mtp_depth: int = 0  # multi-token prediction depths D after the trunk (DeepSeek-V3: 1); 0 = off
    mtp_loss_weight: float = 0.3  # lambda: the loss adds lambda / D * sum of the D depth losses
    # tokens of each sequence per chunk of the LM head + loss (kernels/lm_loss.py): no float32
    # [B, S, V] logits; must divide data.seq_len; 0 = the whole sequence at once
    lm_loss_chunk: int = 0
    # the work outside the pipelined layers (unpipelined layer stacks, final norm, LM head and
    # loss, MTP) runs over this many groups of each device's rows in turn (lax.scan,
    # parallel/row_groups.py): its temporaries are one group's; 1 = all rows at once
    outer_microbatches: int = 1
    pipeline_schedule: str = "gpipe"  # gpipe | circular (V repeats per stage, microbatches >= P)
    pipeline_microbatches: int = 0  # microbatches per step; 0 = number of stages
    pipeline_repeats: int = 2  # circular: layer chunks per stage (bubble shrinks V times)
    # layers of each chunk of the pipelined group in schedule order (gpipe: one per stage;
    # circular: stages x repeats, chunk v*stages + p on stage p); [] = as even as possible.
    # Unequal chunks are padded to the largest with masked identity slots (parallel/schedule.py)
    pipeline_stage_layers: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class AttentionConfig:
    num_heads: int = 4  # H query heads
    num_kv_heads: int = 2  # grouped-query attention: H must be a multiple of this
    head_dim: int = 32  # gqa only; mla head sizes are the qk_*/v_head_dim fields
    rope_theta: float = 10000.0
    kind: str = "gqa"  # gqa (Mixtral, Qwen3) | mla (DeepSeek multi-head latent attention)
    causal_block_size: int = 128  # einsum: queries per block, blocks above the diagonal skipped; 0 = one
    implementation: str = "auto"  # auto (tokamax on NVIDIA GPUs, else einsum) | einsum (XLA, query blocks) | fused (jax.nn.dot_product_attention: cuDNN) | tokamax (Mosaic GPU flash)
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
    # capacity: slots per expert per sequence = ceil(factor * seq_len * K / E); a sequence's
    # assignments compete only among themselves, so drops do not depend on the mesh layout
    capacity_factor: float = 1.25
    drop_policy: str = "position"  # capacity: drop overflow by position | probability (lowest)
    grouped_matmul: str = "auto"  # dropless: tokamax (Mosaic GPU) | ragged_dot | blocked | auto (blocked on CPU, tokamax on NVIDIA GPUs)
    block_size: int = 0  # dropless blocked: rows per block (experts padded to whole blocks); 0 = auto
    transport: str = "auto"  # dropless over an expert axis: all_gather | all_to_all | two_level | auto (parallel/dispatch.py)
    transport_buffer_factor: float = 1.5  # all_to_all: c, slots per (source, dest) pair = ceil(c T K / ep)
    transport_rounds: int = 0  # all_to_all/two_level: static exchange rounds; 0 = enough for any routing (dropless); N = N rounds, the overflow dropped and counted (dropped_fraction)
    overlap_chunks: int = 1  # dropless over an expert axis: each device's tokens in N independent chunks, so one chunk's dispatch/combine can run under another's expert GEMMs (XLA:GPU's scheduler); N > 1 wants moe.transport_rounds=1 (a rounds loop hides its collectives)
    collectives_in_flight: int = 1  # XLA:GPU: at most N collectives in flight at once (xla_gpu_experimental_parallel_collective_overlap_limit; XLA's default 1); 2 lets one chunk's hop-1 exchange across hosts run beside the other chunk's hop 2 and GEMMs (two_level, overlap_chunks 2)
    expert_hosts: int = 0  # two_level: hosts the expert axis spans (hop 1 across them); 0 = mesh.dcn_expert
    router: str = "softmax"  # softmax (Mixtral, Qwen3) | sigmoid (DeepSeek-V3, with a selection bias)
    num_groups: int = 1  # experts form this many contiguous groups (DeepSeek n_group)
    groups_per_token: int = 1  # a token picks experts from its best groups only (DeepSeek topk_group)
    routed_scaling_factor: float = 1.0  # multiplies the routed weights (DeepSeek-V3: 2.5)
    bias_update_speed: float = 0.0  # aux-loss-free balancing: bias += speed * sign(mean - load) per step
    sequence_balance_loss_weight: float = 0.0  # alpha of DeepSeek-V3's per-sequence balance loss


MESH_AXES = ("data", "fsdp", "pipeline", "expert", "tensor")
REMAT_POLICY_NAMES = ("none", "full", "dots", "save_named", "offload_named", "save_received")

# logical axis -> mesh axes. Params: embed, mlp, heads, kv_heads, vocab, experts, expert_mlp,
# layers. Activations: batch, seq, act_embed, act_heads, act_mlp, act_vocab.
DEFAULT_RULES: dict[str, list[str]] = {
    # pipeline: outside the pipeline (embedding, dense prefix, head and loss, MTP) the stage
    # axis splits the batch too; inside, each stage's rows split over the others alone
    # (sharding.within_stages). Last, so that entering the pipeline is an all-gather over it
    # alone (every stage's rows of its shard); a pipeline axis of size 1 adds nothing
    "batch": ["data", "fsdp", "expert", "pipeline"],
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
    # MLA's low-rank dims: their q_b / k_nope / v projections are [rank, heads, head_dim] and
    # only `heads` is otherwise split (over tensor); on fsdp they stop being whole on every
    # device (37.8 GiB of 671B's state at ep 64 x fsdp 32, issue 24's plan)
    "q_lora": ["fsdp"],
    "kv_lora": ["fsdp"],
}


# leading dims that lax.scan and the pipeline slice one layer / stage at a time: a storage axis
# placed there would make every slice gather the whole stack
STACK_AXES = ("layers", "stage")


def stage_local_rules(rules: dict[str, list[str]]) -> dict[str, list[str]]:
    """`rules` as the pipeline's stages see them: the stage mesh axes (those of logical
    "stage") dropped from every logical axis but STACK_AXES. Outside the pipeline those axes
    split the batch like data (DEFAULT_RULES); inside, each stage holds its own microbatch
    rows and "batch" means the split of those rows alone. Here (jax-free) so validation.py
    checks the same rules sharding.within_stages applies."""
    stage = set(rules.get("stage", []))
    return {k: list(v) if k in STACK_AXES else [a for a in v if a not in stage]
            for k, v in rules.items()}


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
    # what compute reads the weights from (sharding.compute_axes): zero3 = the sharded state, gathered at every use | zero1 = a bf16 copy replicated over data and fsdp, made once per step, gradients reduced once per step | hsdp = zero1's copy also split over the storage axes inside a host
    weights: str = "zero3"
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
    # FP8 (E4M3) GEMMs of the attention projections, dense MLPs and shared / routed experts:
    # none | tensorwise (one current-scaled scale per tensor) | blockwise (DeepSeek-V3's 1x128
    # / 128x128 tiles); kernels/fp8.py. Needs compute_dtype bfloat16 or float32. Either mode also
    # sends the MoE dispatch's tokens in E4M3 1x128 tiles (DeepSeek-V3 3.3; combine in bf16)
    fp8: str = "none"


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # 'stdlib' (this interpreter's Python sources), a glob of text files
    # or a folder written by `maxmoe data prepare`
    tokenizer_dir: str = ""  # trained SentencePiece model dir; empty = cache under ~/.cache/maxmoe
    seq_len: int = 128  # S, tokens per packed row
    global_batch_size: int = 16  # B, rows per optimizer step across all processes
    seed: int = 0  # shuffling seed
    num_workers: int = 0  # grain worker processes (0 = in the main process)
    streams: int = 16  # train and validation rows interleave this many packed document streams
    prefetch_batches: int = 4  # train batches kept ready ahead of the step (per worker; 0 = off)
    validation_fraction: float = 0.02  # documents held out for evaluation (raw sources only)
    # weighted prepared datasets 'DIR:WEIGHT,DIR:WEIGHT' (weights = token shares); empty =
    # `source` alone. `source` may itself be a folder written by `maxmoe data prepare`.
    mixture: str = ""
    # pretrain (documents of text, every token trained) | sft (JSONL chat records: `source` is a
    # glob of .jsonl files with `messages` or `prompt`/`completion`; only answers are trained)
    format: str = "pretrain"

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
    checksums: bool = True  # crc32c per saved chunk, checked on restore (train/checksums.py)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200  # optimizer steps
    # microbatches per optimizer step: the global batch is split, each microbatch's loss weighted
    # by its loss tokens, so the step equals the unsplit batch's (train/gradients.py, make_gradients)
    grad_accum_steps: int = 1
    seed: int = 0  # parameter init seed
    eval_every_steps: int = 0  # validation loss every N steps (ranks checkpoint.keep_best); 0 = off
    eval_batches: int = 4  # validation batches per evaluation
    # start from these weights (a maxmoe run or converted dir, or an HF model dir); optimizer,
    # step and data start fresh; ignored once run.dir has its own checkpoints (train/init_from.py)
    init_from: str = ""


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
    dead_expert_windows: int = 3  # an expert with no tokens for this many logging windows is dead
    router_action: str = "warn"  # on dead experts: warn (log + event once per change) | stop
    load_ratio_warn: float = 10.0  # warn when a MoE layer's max/mean expert load passes this; 0 off


@dataclass(frozen=True)
class LoggingConfig:
    every_steps: int = 10  # metrics.jsonl / progress bar update period
    progress_bar: bool = True
    peak_flops_per_device: float = 0.0  # for MFU; 0 = known GPU table, or measured on CPU
    profile_start: int = 0  # first step traced into <run.dir>/profile (train/profiling.py); 0 = off
    profile_steps: int = 3  # steps traced from profile_start (two keys: YAML reads 10:20 as 620)
    tensorboard: bool = True  # TensorBoard event files in <run.dir>/tensorboard (process 0)
    wandb_project: str = ""  # W&B project to log to; empty = off (pip install 'maxmoe[wandb]')
    wandb_mode: str = "offline"  # W&B mode: offline (no network; `wandb sync` later) | online
    per_layer: bool = True  # per-layer arrays (docs/observability.md) on logged steps; false: none
    side_work_timeout_s: int = 120  # process 0's work beside the job (plan.json); longer: skipped


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


# --------------------------------------------------------------------------- errors


def describe(key: str, value: Any, origin: str | None = None) -> str:
    """"config key 'K' = V (from ORIGIN)": how every config error names its subject; code
    that no longer knows where the value came from (the data pipeline) passes origin=None."""
    return f"config key '{key}' = {value!r}" + (f" (from {origin})" if origin else "")


def fail(key: str, value: Any, origin: str | None, problem: str, fix: str) -> typing.NoReturn:
    """Raises the one-line ConfigError "config key 'K' = V (from ORIGIN): PROBLEM; FIX"."""
    raise ConfigError(f"{describe(key, value, origin)}: {problem}; {fix}")
