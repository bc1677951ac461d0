"""The checks of one config section each: `check_<section>(section, need)` reads that section's own
fields alone (SECTION_CHECKS, in the order of config.py's dataclasses) and fails through `Need`
with one line naming the key, its value, where it came from and the fix. validation.py runs them
before the checks that join sections or judge the config against the devices.
"""

from __future__ import annotations

from maxmoe.config import (
    MESH_AXES,
    REMAT_POLICY_NAMES,
    AttentionConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    DistributedConfig,
    GuardConfig,
    LoggingConfig,
    MeshConfig,
    ModelConfig,
    MoEConfig,
    OptimizerConfig,
    PrecisionConfig,
    TrainConfig,
    fail,
)


class Need:
    """`need(ok, "section.key", problem, fix)` fails with the key's value and origin unless ok."""

    def __init__(self, cfg: Config, origins: dict[str, str]):
        self.cfg, self.origins = cfg, origins

    def origin(self, key: str) -> str:
        return self.origins.get(key, "defaults")

    def value(self, key: str):
        section, name = key.split(".")
        return getattr(getattr(self.cfg, section), name)

    def __call__(self, ok: bool, key: str, problem: str, fix: str) -> None:
        if not ok:
            fail(key, self.value(key), self.origin(key), problem, fix)

    def positive(self, *keys: str) -> None:
        for key in keys:
            self(self.value(key) >= 1, key, "must be >= 1", "use a positive value")


# --------------------------------------------------------------------------- one section each


def check_model(m: ModelConfig, need: Need) -> None:
    need.positive("model.vocab_size", "model.hidden_size", "model.num_layers",
                  "model.dense_mlp_size")
    need(0 <= m.num_dense_layers <= m.num_layers, "model.num_dense_layers",
         f"must be between 0 and model.num_layers ({m.num_layers})", "lower it")
    need(m.remat_policy in REMAT_POLICY_NAMES, "model.remat_policy", "unknown policy",
         f"use one of: {', '.join(REMAT_POLICY_NAMES)}")
    need(m.moe_layer_step >= 1, "model.moe_layer_step", "must be >= 1", "use 1 (every layer MoE)")
    need(all(0 <= i < m.num_layers for i in m.dense_layer_indices), "model.dense_layer_indices",
         f"every index must be in [0, model.num_layers) = [0, {m.num_layers})", "drop the others")
    need(m.mtp_depth >= 0, "model.mtp_depth", "must be >= 0", "use 0 (off) or 1 (DeepSeek-V3)")
    need(m.pipeline_schedule in ("gpipe", "circular"), "model.pipeline_schedule",
         "unknown schedule", "use gpipe or circular")
    need(m.pipeline_microbatches >= 0 and m.pipeline_repeats >= 1, "model.pipeline_microbatches",
         "microbatches must be >= 0 and repeats >= 1", "use e.g. 0 (= stages) and 2")


def check_attention(a: AttentionConfig, need: Need) -> None:
    need.positive("attention.num_heads", "attention.num_kv_heads", "attention.head_dim")
    need(a.causal_block_size >= 0, "attention.causal_block_size", "must be >= 0",
         "use 0 (one block) or a number of query rows such as 256")
    need(a.num_heads % a.num_kv_heads == 0, "attention.num_kv_heads",
         f"must divide attention.num_heads ({a.num_heads})", "pick a divisor of the head count")
    need(a.kind in ("gqa", "mla"), "attention.kind", "unknown attention", "use gqa or mla")
    need(a.implementation in ("auto", "einsum", "fused", "tokamax"), "attention.implementation",
         "unknown implementation", "use auto, einsum, fused or tokamax")
    if a.kind == "mla":
        for key in ("attention.kv_lora_rank", "attention.qk_nope_head_dim",
                    "attention.qk_rope_head_dim", "attention.v_head_dim"):
            need(need.value(key) >= 1, key, "must be >= 1 for mla", "use a positive value")
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


def check_moe(e: MoEConfig, need: Need) -> None:
    need.positive("moe.num_experts", "moe.experts_per_token", "moe.expert_mlp_size")
    need(e.experts_per_token <= e.num_experts, "moe.experts_per_token",
         f"top-k cannot exceed moe.num_experts ({e.num_experts})", "lower it or add experts")
    need(e.num_shared_experts >= 0, "moe.num_shared_experts", "must be >= 0", "use 0 or more")
    need(e.dispatch in ("dropless", "capacity"), "moe.dispatch", "unknown dispatch",
         "use dropless or capacity")
    need(e.capacity_factor > 0, "moe.capacity_factor", "must be > 0", "use e.g. 1.25")
    need(e.grouped_matmul in ("auto", "tokamax", "ragged_dot", "blocked"),
         "moe.grouped_matmul", "unknown grouped matmul", "use auto, tokamax, ragged_dot or blocked")
    need(e.block_size >= 0, "moe.block_size", "must be >= 0", "use 0 (auto) or e.g. 128")
    need(e.transport in ("auto", "all_gather", "all_to_all", "two_level"), "moe.transport",
         "unknown transport", "use auto, all_gather, all_to_all or two_level")
    need(e.expert_hosts >= 0, "moe.expert_hosts", "must be >= 0",
         "use 0 (mesh.dcn_expert) or the hosts the expert axis spans")
    need(e.transport == "auto" or e.dispatch == "dropless", "moe.transport",
         "moe.dispatch=capacity moves its slot buffers with its own all-to-all",
         "set moe.transport=auto or moe.dispatch=dropless")
    need(e.transport_buffer_factor > 0, "moe.transport_buffer_factor", "must be > 0",
         "use e.g. 1.5 (more slots per round: fewer rounds, bigger buffers)")
    need(e.transport_rounds >= 0, "moe.transport_rounds", "must be >= 0",
         "use 0 (enough rounds for any routing, nothing dropped) or a round count")
    need(e.overlap_chunks >= 1, "moe.overlap_chunks", "must be >= 1",
         "use 1 (one exchange per layer) or 2 (two token chunks, overlapped)")
    need(e.collectives_in_flight >= 1, "moe.collectives_in_flight", "must be >= 1",
         "use 1 (XLA:GPU's default: one collective at a time) or 2")
    need(e.overlap_chunks == 1 or e.dispatch == "dropless", "moe.overlap_chunks",
         "moe.dispatch=capacity counts its slots per sequence, not per chunk",
         "set moe.overlap_chunks=1 or moe.dispatch=dropless")
    need(e.drop_policy in ("position", "probability"), "moe.drop_policy", "unknown policy",
         "use position or probability")
    need(e.router in ("softmax", "sigmoid"), "moe.router", "unknown router",
         "use softmax or sigmoid")
    need(e.num_groups >= 1 and e.num_experts % e.num_groups == 0, "moe.num_groups",
         f"must be >= 1 and divide moe.num_experts ({e.num_experts})", "pick a divisor")
    if e.num_groups > 1:
        need(e.num_experts // e.num_groups >= 2, "moe.num_groups",
             "groups are ranked by their top-2 scores, so each needs >= 2 experts",
             "use fewer groups")
    need(1 <= e.groups_per_token <= e.num_groups, "moe.groups_per_token",
         f"must be between 1 and moe.num_groups ({e.num_groups})", "lower it")
    need(e.experts_per_token <= e.groups_per_token * (e.num_experts // e.num_groups),
         "moe.experts_per_token", "more than the experts of moe.groups_per_token groups",
         "raise moe.groups_per_token or lower the top-k")
    need(e.bias_update_speed >= 0, "moe.bias_update_speed", "must be >= 0", "use 0 (off) or 0.001")
    need(e.bias_update_speed == 0 or e.router == "sigmoid", "moe.bias_update_speed",
         "the selection bias exists only with moe.router=sigmoid", "set moe.router=sigmoid or 0")


def check_mesh(mesh: MeshConfig, need: Need) -> None:
    """The rules table names only mesh axes, each at most once per logical axis (the axis
    sizes need the devices: see below), and mesh.weights is a mode sharding.compute_axes knows."""
    need(mesh.weights in ("zero3", "zero1", "hsdp"), "mesh.weights", "unknown weight sharding",
         "use zero3 (gathered per use), zero1 (replicated copy per step) or hsdp")
    for logical, axes in mesh.rules.items():
        for ax in axes:
            if ax not in MESH_AXES:
                fail(f"mesh.rules.{logical}", axes, need.origin("mesh.rules"),
                     f"unknown mesh axis {ax!r}", f"use axes from: {', '.join(MESH_AXES)}")
        if len(set(axes)) < len(axes):
            fail(f"mesh.rules.{logical}", axes, need.origin("mesh.rules"),
                 "names a mesh axis twice (a dimension is split over each axis once)",
                 "list each mesh axis once")


def check_optimizer(op: OptimizerConfig, need: Need) -> None:
    need(op.moment_dtype in ("float32", "bfloat16"), "optimizer.moment_dtype", "unknown dtype",
         "use float32 or bfloat16")
    need(op.grad_clip_norm >= 0, "optimizer.grad_clip_norm", "must be >= 0", "use 0 (off) or 1.0")
    need(op.grad_clip_end_norm >= 0 and (op.grad_clip_end_norm == 0 or op.grad_clip_norm > 0),
         "optimizer.grad_clip_end_norm", "must be >= 0, and a decay needs grad_clip_norm > 0",
         "use 0 (constant) or set optimizer.grad_clip_norm")
    need(op.grad_clip_decay_steps >= 0, "optimizer.grad_clip_decay_steps", "must be >= 0",
         "use 0 (until train.steps)")


def check_precision(pr: PrecisionConfig, need: Need) -> None:
    need(pr.compute_dtype in ("bfloat16", "float16", "float32"), "precision.compute_dtype",
         "unknown dtype", "use bfloat16, float16 or float32")
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
    need(pr.fp8 in ("none", "tensorwise", "blockwise"), "precision.fp8",
         f"unknown FP8 mode {pr.fp8!r}", "use none, tensorwise or blockwise")
    need(pr.fp8 == "none" or pr.compute_dtype != "float16", "precision.fp8",
         f"fp8 {pr.fp8} with compute_dtype float16: FP8 training keeps BF16 compute",
         "set precision.compute_dtype=bfloat16 or precision.fp8=none")


def check_data(d: DataConfig, need: Need) -> None:
    need.positive("data.seq_len", "data.global_batch_size")
    need(d.streams >= 1, "data.streams", "must be >= 1", "use 1 for a single stream")
    need(0.0 <= d.validation_fraction < 1.0, "data.validation_fraction", "must be in [0, 1)",
         "use e.g. 0.02")
    need(d.prefetch_batches >= 1, "data.prefetch_batches", "must be >= 1", "use e.g. 4")
    need(d.format in ("pretrain", "sft"), "data.format", "unknown format",
         "use pretrain (text documents) or sft (JSONL chat records)")
    try:
        d.mixture_weights()
    except ValueError as error:
        need(False, "data.mixture", str(error), "write e.g. 'data/web:0.7,data/code:0.3'")


def check_checkpoint(c: CheckpointConfig, need: Need) -> None:
    need.positive("checkpoint.every_steps", "checkpoint.keep")
    need(c.keep_best >= 0, "checkpoint.keep_best", "must be >= 0", "use 0 (off) or e.g. 1")


def check_train(t: TrainConfig, need: Need) -> None:
    need.positive("train.steps", "train.grad_accum_steps")
    need(t.eval_every_steps >= 0, "train.eval_every_steps", "must be >= 0",
         "use 0 (off) or e.g. 50")
    need(t.eval_batches >= 1, "train.eval_batches", "must be >= 1", "use e.g. 4")


def check_guard(g: GuardConfig, need: Need) -> None:
    need(g.max_consecutive_skips >= 0, "guard.max_consecutive_skips", "must be >= 0",
         "use 0 (never stop) or e.g. 50")
    need(g.grad_norm_ceiling >= 0, "guard.grad_norm_ceiling", "must be >= 0", "use 0 (off) or 1e3")
    need(g.spike_action in ("none", "skip", "rollback"), "guard.spike_action", "unknown action",
         "use none, skip or rollback")
    need(g.spike_window >= 2, "guard.spike_window", "must be >= 2", "use e.g. 100")
    need(g.spike_zscore > 0, "guard.spike_zscore", "must be > 0", "use e.g. 6")
    need(g.rollback_extra_batches >= 0, "guard.rollback_extra_batches", "must be >= 0", "use 0")
    need(g.max_rollbacks >= 0, "guard.max_rollbacks", "must be >= 0", "use e.g. 5")
    need(g.dead_expert_windows >= 1, "guard.dead_expert_windows", "must be >= 1", "use e.g. 3")
    need(g.router_action in ("warn", "stop"), "guard.router_action", "unknown action",
         "use warn or stop")
    need(g.load_ratio_warn >= 0, "guard.load_ratio_warn", "must be >= 0", "use 0 (off) or e.g. 10")


def check_logging(lg: LoggingConfig, need: Need) -> None:
    need.positive("logging.every_steps")
    need(lg.profile_start >= 0, "logging.profile_start", "must be >= 0",
         "use 0 (off) or the first step to trace, e.g. 10")
    need(lg.profile_start == 0 or lg.profile_steps >= 1, "logging.profile_steps",
         "must be >= 1 when logging.profile_start is set", "use e.g. 3")


def check_distributed(dist: DistributedConfig, need: Need) -> None:
    for key in ("distributed.initialization_timeout_s", "distributed.heartbeat_timeout_s",
                "distributed.shutdown_timeout_s"):
        need(need.value(key) >= 1, key, "must be >= 1 second", "use e.g. 60")
    need(dist.num_processes >= 0, "distributed.num_processes", "must be >= 0",
         "use 0 (from the environment) or the process count")
    need(dist.process_id == -1 or 0 <= dist.process_id < max(dist.num_processes, 1),
         "distributed.process_id", f"must be -1 or in [0, distributed.num_processes = "
         f"{dist.num_processes})", "use 0 .. num_processes - 1 and set num_processes")
    host, colon, port = dist.coordinator_address.rpartition(":")
    need(not dist.coordinator_address or bool(host and colon and port.isdigit()),
         "distributed.coordinator_address", "expected host:port", "write e.g. 10.0.0.1:8476")


SECTION_CHECKS = {
    "model": check_model, "attention": check_attention, "moe": check_moe, "mesh": check_mesh,
    "optimizer": check_optimizer, "precision": check_precision, "data": check_data,
    "checkpoint": check_checkpoint, "train": check_train, "guard": check_guard,
    "logging": check_logging, "distributed": check_distributed,
}
