"""Checks a loaded Config against the devices before anything compiles.

`validate(cfg, num_devices, origins)` returns the mesh axis sizes or raises ConfigError with
one line naming the key, its value, where it came from and the fix.

The checks of one section's own fields are section_checks.py's; here are the checks that join
sections, or judge the config against the devices (the mesh shape, hosts, pipeline stages,
shards). They live apart from config.py so that config.py stays about loading and types.
"""

from __future__ import annotations

import math

from maxmoe.config import (
    MESH_AXES,
    Config,
    fail,
    stage_local_rules,
)
from maxmoe.data.corpus import STDLIB
from maxmoe.model.spec import layer_groups
from maxmoe.parallel.schedule import pipeline_schedule
from maxmoe.section_checks import SECTION_CHECKS, Need

# The largest vocabulary the stdlib fallback is for: its tokenizer is trained on a ~4 MB
# sample (data/tokenizer.py), which SentencePiece BPE cannot fill past ~61K pieces (61,225 on
# Python 3.11's stdlib), and 2^15 is the largest the shipped configs train on it
# (configs/bench/h200_deepseek_1b.yaml). Bigger vocabularies belong to models for real corpora.
STDLIB_MAX_VOCAB = 32768


# --------------------------------------------------------------------------- across sections


def check_best_checkpoint_needs_evals(cfg: Config, need: Need) -> None:
    need(cfg.checkpoint.keep_best == 0 or cfg.train.eval_every_steps > 0, "checkpoint.keep_best",
         "ranking by eval loss needs evaluations", "set train.eval_every_steps or keep_best=0")


def check_profile_window(cfg: Config, need: Need) -> None:
    start, steps = cfg.logging.profile_start, cfg.logging.profile_steps
    need(start == 0 or start + steps - 1 <= cfg.train.steps, "logging.profile_start",
         f"traces steps {start}-{start + steps - 1}, past train.steps = {cfg.train.steps}",
         "start earlier, trace fewer logging.profile_steps, or raise train.steps")


def check_side_work_bound(cfg: Config, need: Need) -> None:
    """Process 0's side work must end before the other processes' barrier gives up on it."""
    bound, barrier = cfg.logging.side_work_timeout_s, cfg.distributed.initialization_timeout_s
    need(0 < bound < barrier, "logging.side_work_timeout_s", f"must be > 0 and below "
         f"distributed.initialization_timeout_s = {barrier} (the barrier it runs before)",
         f"use e.g. {barrier // 2}")


def check_loss_chunk(cfg: Config, need: Need) -> None:
    chunk = cfg.model.lm_loss_chunk
    need(chunk >= 0 and (chunk == 0 or cfg.data.seq_len % chunk == 0), "model.lm_loss_chunk",
         f"must be 0 or divide data.seq_len = {cfg.data.seq_len}",
         "use 0 (whole sequence) or a divisor such as 1024")


def resolve_mesh_shape(cfg: Config, num_devices: int, origins: dict[str, str]) -> dict[str, int]:
    """Mesh axis sizes with a -1 axis filled in; fails unless the product is num_devices."""
    sizes = {a: getattr(cfg.mesh, a) for a in MESH_AXES}
    free = [a for a, s in sizes.items() if s == -1]
    for a, s in sizes.items():
        if s == 0 or s < -1:
            fail(f"mesh.{a}", s, origins.get(f"mesh.{a}", "defaults"), "must be >= 1 or -1 (fill)",
                  "set a positive size")
    if len(free) > 1:
        fail(f"mesh.{free[1]}", -1, origins.get(f"mesh.{free[1]}", "defaults"),
              "only one mesh axis may be -1", "give the others explicit sizes")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if num_devices % fixed:
            a = _culprit(sizes, origins, num_devices)  # the -1 axis is not at fault
            fail(f"mesh.{a}", sizes[a], origins.get(f"mesh.{a}", "defaults"),
                 f"the set axes multiply to {fixed}, which does not divide {num_devices} devices "
                 f"(mesh.{free[0]} = -1 takes the rest)",
                 "change the axis sizes so their product divides the device count")
        sizes[free[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        shape = " x ".join(f"{a}={s}" for a, s in sizes.items())
        key = f"mesh.{_culprit(sizes, origins, num_devices)}"
        fail(key, getattr(cfg.mesh, key.split(".")[1]), origins.get(key, "defaults"),
              f"mesh {shape} has {math.prod(sizes.values())} devices but {num_devices} are present",
              "make the product of the mesh axes equal the device count (or set one axis to -1)")
    return sizes


def _culprit(sizes: dict[str, int], origins: dict[str, str], num_devices: int) -> str:
    """The mesh axis a wrong device product is blamed on: one set above 1, preferring one that
    does not divide the devices, then one from the command line (the newest edit)."""
    given = [a for a in MESH_AXES if sizes[a] > 1] or list(MESH_AXES)
    return min(given, key=lambda a: (num_devices % sizes[a] == 0,
                                     origins.get(f"mesh.{a}") != "command line"))


def dcn_sizes(cfg: Config) -> dict[str, int]:
    return {a: getattr(cfg.mesh, f"dcn_{a}") for a in MESH_AXES}


def check_hosts(cfg: Config, sizes: dict[str, int], num_devices: int, num_processes: int,
                need: Need) -> None:
    """Each DCN factor divides its axis, and the factors multiply to the process (host) count."""
    dcn = dcn_sizes(cfg)
    for ax, n in dcn.items():
        need(n >= 1 and sizes[ax] % n == 0, f"mesh.dcn_{ax}",
             f"must be >= 1 and divide mesh.{ax} ({sizes[ax]})", "use a divisor of the axis size")
    hosts = math.prod(dcn.values())
    need(hosts == num_processes or (num_processes == 1 and num_devices % hosts == 0),
         "mesh.dcn_data", f"the dcn factors multiply to {hosts} but there are {num_processes} "
         "processes (hosts)", "make the product of mesh.dcn_* equal the number of hosts")


def shards(cfg: Config, sizes: dict[str, int], logical: str) -> int:
    """How many pieces the rules table cuts logical axis `logical` into on this mesh."""
    return math.prod(sizes[ax] for ax in cfg.mesh.rules[logical])


def stage_batch_shards(cfg: Config, sizes: dict[str, int]) -> int:
    """How many pieces one pipeline stage's rows are cut into: the batch axes but the stage
    axes (config.stage_local_rules), which split the rows only outside the pipeline."""
    return math.prod(sizes[ax] for ax in stage_local_rules(cfg.mesh.rules)["batch"])


def check_pipeline(cfg: Config, sizes: dict[str, int], need: Need) -> None:
    """mesh.pipeline stages split a run of stacked same-kind layers into chunks of at least
    one layer (model.pipeline_stage_layers, if set, says how), and the batch per step."""
    m, stages = cfg.model, sizes["pipeline"]
    if stages == 1:
        return
    need(m.scan_layers, "model.scan_layers", f"mesh.pipeline={stages} splits stacked "
         "layers into stages; scan_layers=false keeps each layer's params apart",
         "set model.scan_layers=true (or mesh.pipeline=1)")
    schedule = pipeline_schedule(m, stages)
    sizes_of_groups = [n for _, _, n in layer_groups(m)]
    split = m.pipeline_stage_layers
    if split:
        need(len(split) == schedule.chunks and min(split) >= 1, "model.pipeline_stage_layers",
             f"needs {schedule.chunks} entries >= 1 (mesh.pipeline={stages} stages x "
             f"{schedule.repeats} repeats, chunk v*stages + p on stage p)",
             "give one layer count per chunk, or [] to split evenly")
        need(sum(split) in sizes_of_groups, "model.pipeline_stage_layers",
             f"sums to {sum(split)}, no run of same-kind layers has that many (sizes "
             f"{sizes_of_groups})", "make it sum to the pipelined group's layers")
    need(any(schedule.pipelines(n) for n in sizes_of_groups), "mesh.pipeline",
         f"no run of same-kind layers (sizes {sizes_of_groups}) has a layer for each of "
         f"{stages} stages x {schedule.repeats} repeats", "lower mesh.pipeline or "
         "model.pipeline_repeats")
    micro = schedule.microbatches
    need(schedule.repeats == 1 or micro >= stages, "model.pipeline_microbatches",
         f"the circular schedule needs at least mesh.pipeline={stages} microbatches",
         f"use 0 (= stages) or >= {stages}")
    per_step = cfg.data.global_batch_size // cfg.train.grad_accum_steps
    inside = stage_batch_shards(cfg, sizes)
    need(per_step % (micro * inside) == 0, "data.global_batch_size",
         f"each of the {micro} pipeline microbatches needs a whole number of rows per batch "
         f"shard of a stage ({inside})", f"use a larger multiple of the batch shards: of {micro * inside} x "
         "train.grad_accum_steps")


def check_model_shards(cfg: Config, sizes: dict[str, int], need: Need) -> None:
    """Every sharded model size divides into the shards of its logical axis."""
    m, a, e = cfg.model, cfg.attention, cfg.moe
    for key, value, logical in [
        ("attention.num_heads", a.num_heads, "heads"),
        ("attention.num_kv_heads", a.num_kv_heads, "kv_heads"),
        ("moe.num_experts", e.num_experts, "experts"),
        ("moe.expert_mlp_size", e.expert_mlp_size, "expert_mlp"),
        ("model.dense_mlp_size", m.dense_mlp_size, "mlp"),
        ("model.vocab_size", m.vocab_size, "vocab"),
        ("model.hidden_size", m.hidden_size, "embed"),
    ]:
        n = shards(cfg, sizes, logical)
        need(value % n == 0, key, f"not divisible by the {n} shards of logical axis '{logical}' "
             f"(mesh axes {cfg.mesh.rules[logical]})", f"use a multiple of {n} or change the mesh")


def check_two_level(cfg: Config, sizes: dict[str, int], need: Need) -> None:
    """moe.transport=two_level (parallel/two_level.py): group-limited routing, one expert mesh
    axis that also shards the batch, and whole expert groups on each of its hosts."""
    e, axes = cfg.moe, cfg.mesh.rules.get("experts", [])
    if e.transport != "two_level" or math.prod(sizes[a] for a in axes) == 1:
        return
    fix = "or use moe.transport=all_to_all"
    need(1 < e.num_groups and e.groups_per_token < e.num_groups, "moe.transport",
         f"two_level needs group-limited routing, but moe.num_groups={e.num_groups} and "
         f"moe.groups_per_token={e.groups_per_token}",
         f"set moe.num_groups > moe.groups_per_token (DeepSeek-V3: 8 and 4) {fix}")
    need(len(axes) == 1 and axes[0] in cfg.mesh.rules.get("batch", []), "moe.transport",
         f"two_level splits one expert mesh axis that also shards the batch; mesh.rules.experts "
         f"is {axes}", f"map mesh.rules.experts to one axis of mesh.rules.batch {fix}")
    ep, hosts = sizes[axes[0]], e.expert_hosts or getattr(cfg.mesh, f"dcn_{axes[0]}")
    need(ep % hosts == 0 and e.num_groups % hosts == 0, "moe.transport",
         f"two_level puts whole expert groups on each host, but the {ep} expert shards span "
         f"{hosts} hosts (moe.expert_hosts, else mesh.dcn_{axes[0]}) for "
         f"moe.num_groups={e.num_groups}", f"use a host count dividing both {fix}")


def check_batch_shards(cfg: Config, sizes: dict[str, int], need: Need) -> None:
    """The global batch splits into whole rows per batch shard and accumulation step."""
    batch_shards = shards(cfg, sizes, "batch") * cfg.train.grad_accum_steps
    need(cfg.data.global_batch_size % batch_shards == 0, "data.global_batch_size",
         f"not divisible by batch shards x grad_accum_steps ({batch_shards}) over mesh axes "
         f"{[a for a in cfg.mesh.rules['batch'] if sizes[a] > 1]}",
         f"use a multiple of {batch_shards}")


def check_outer_microbatches(cfg: Config, sizes: dict[str, int], need: Need) -> None:
    """model.outer_microbatches groups split every device's rows of an accumulation step
    evenly (parallel/row_groups.py: then the regrouping moves nothing between devices)."""
    groups = cfg.model.outer_microbatches
    need(groups >= 1, "model.outer_microbatches", f"is {groups}, must be >= 1",
         "use 1 (all rows at once) or more groups")
    rows = cfg.data.global_batch_size // (shards(cfg, sizes, "batch") * cfg.train.grad_accum_steps)
    need(groups == 1 or rows % groups == 0, "model.outer_microbatches",
         f"{groups} groups do not divide the {rows} rows each device holds per accumulation step",
         f"use a divisor of {rows}")


def check_data_fits_model(cfg: Config, need: Need) -> None:
    """A model with a big vocabulary names its data: the stdlib fallback would otherwise
    train a tokenizer of that size on a few MB of Python sources (and fail, or be useless)."""
    d = cfg.data
    falls_back = d.source == STDLIB and not d.tokenizer_dir and not d.mixture.strip()
    need(not falls_back or cfg.model.vocab_size <= STDLIB_MAX_VOCAB, "data.source",
         f"model.vocab_size={cfg.model.vocab_size} needs real data: the stdlib fallback trains "
         f"tokenizers of at most {STDLIB_MAX_VOCAB} pieces on a few MB of Python sources",
         "set data.source to a folder written by `maxmoe data prepare` (or "
         "data.mixture='DIR:WEIGHT,...'), or data.tokenizer_dir to a tokenizer of that size")


def validate(cfg: Config, num_devices: int, origins: dict[str, str],
             num_processes: int = 1, *, reads_data: bool = False) -> dict[str, int]:
    """Checks everything that can be checked before compiling; returns the mesh shape.

    origins: key -> where its value came from (load_config's); a missing key reads 'defaults'.
    reads_data: the run reads cfg.data (train; bench's batches are synthetic), so the data
    must suit the model too (check_data_fits_model).
    """
    need = Need(cfg, origins)
    for section, check in SECTION_CHECKS.items():
        check(getattr(cfg, section), need)
    check_best_checkpoint_needs_evals(cfg, need)
    check_loss_chunk(cfg, need)
    check_profile_window(cfg, need)
    check_side_work_bound(cfg, need)
    if reads_data:
        check_data_fits_model(cfg, need)
    sizes = resolve_mesh_shape(cfg, num_devices, origins)
    check_hosts(cfg, sizes, num_devices, num_processes, need)
    check_pipeline(cfg, sizes, need)
    check_model_shards(cfg, sizes, need)
    check_two_level(cfg, sizes, need)
    check_batch_shards(cfg, sizes, need)
    check_outer_microbatches(cfg, sizes, need)
    return sizes
