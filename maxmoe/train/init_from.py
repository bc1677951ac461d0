"""train.init_from: a run's first state with a checkpoint's weights and everything else fresh.

The source is a maxmoe training run (its newest step, or one `checkpoints/<step>` folder), a
directory written by `maxmoe convert from-hf`, or a Hugging Face model directory read directly.
Only the params and the router-bias buffers are loaded; the optimizer state, step, data
position, guard counters and loss scale are those of a new run.

Loading is sharded: every process places only its own devices' shards. A maxmoe checkpoint is
restored by Orbax onto the run's shardings; an HF checkpoint is read slice by slice from its
safetensors (`hf/slices.py`, `jax.make_array_from_callback`), so no host holds more than
its share of the model plus one hub tensor.

The run's architecture (ARCHITECTURE below) must equal the checkpoint's; a mismatch is a
one-line ConfigError naming the field, raised before anything is compiled. Two exceptions:
model.mtp_depth=0 drops a checkpoint's MTP weights (with a warning), and model.scan_layers may
differ (stacked and per-layer params are converted on the devices, one layer group at a time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from maxmoe.config import Config, ConfigError, fail
from maxmoe.config_files import load_config
from maxmoe.hf.safetensors_io import ConversionError
from maxmoe.hf.slices import LeafReader
from maxmoe.parallel.dispatch import resolve_transport
from maxmoe.sharding import path_keys, use_mesh
from maxmoe.train import saved_steps
from maxmoe.train.evaluate import find_checkpoint, run_config_file
from maxmoe.train.step import Trainer, state_layout

KEY = "train.init_from"
WEIGHTS = ("params", "buffers")  # the state items a checkpoint's weights fill
# fields that decide the params' shapes or the function the model computes
MODEL_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_dense_layers", "dense_mlp_size",
                "rms_norm_eps", "moe_layer_step", "dense_layer_indices", "mtp_depth")
ATTENTION_FIELDS = {
    "": ("kind", "num_heads", "rope_theta", "rope_interleave", "rope_scaling"),
    "gqa": ("num_kv_heads", "head_dim", "qk_norm"),
    "mla": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    "yarn": ("rope_factor", "rope_original_max_positions", "rope_beta_fast", "rope_beta_slow",
             "rope_truncate", "rope_mscale", "rope_mscale_all_dim"),
}
MOE_FIELDS = ("num_experts", "experts_per_token", "expert_mlp_size", "num_shared_experts",
              "normalize_top_k", "router", "num_groups", "groups_per_token",
              "routed_scaling_factor")


@dataclasses.dataclass(frozen=True)
class InitSource:
    """A checkpoint a run starts from: where, what kind, and the config it was saved with."""
    path: Path  # as given (resolved)
    kind: str  # "hf" | "converted" | "run"
    cfg: Config  # the checkpoint's config (HF: config_from_hf of its config.json)
    step_dir: Path | None = None  # kind "run": the committed step read
    warnings: tuple[str, ...] = ()  # for the run's log (MTP weights dropped)

    def describe(self) -> str:
        what = {"hf": "Hugging Face checkpoint", "converted": "converted checkpoint",
                "run": f"run checkpoint step {self.step_dir.name if self.step_dir else '?'}"}
        return f"{what[self.kind]} {self.path}"


def architecture(cfg: Config) -> dict[str, Any]:
    """{dotted key: value} of the fields a checkpoint's weights depend on (ARCHITECTURE)."""
    a = cfg.attention
    keys = [f"model.{k}" for k in MODEL_FIELDS] + [f"moe.{k}" for k in MOE_FIELDS]
    keys += [f"attention.{k}" for k in ATTENTION_FIELDS[""] + ATTENTION_FIELDS.get(a.kind, ())]
    if a.rope_scaling == "yarn":
        keys += [f"attention.{k}" for k in ATTENTION_FIELDS["yarn"]]
    return {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in keys}


def check_architecture(cfg: Config, source: InitSource) -> list[str]:
    """Raises a one-line ConfigError at the first architecture field where cfg differs from
    the checkpoint; returns the warnings of the allowed differences (MTP weights dropped)."""
    ours, theirs = architecture(cfg), architecture(source.cfg)
    ours.update({k: v for k, v in theirs.items() if k not in ours})  # e.g. a yarn field
    theirs.update({k: v for k, v in ours.items() if k not in theirs})
    warnings = []
    for key, value in ours.items():
        if value == theirs[key]:
            continue
        if key == "model.mtp_depth" and value == 0:
            warnings.append(f"warning: {KEY}: model.mtp_depth=0 drops the checkpoint's "
                            f"{theirs[key]} MTP depth(s) (their weights are not loaded)")
            continue
        fail(key, value, None, f"{KEY}={source.path} holds a model with {key}="
             f"{theirs[key]!r}", f"set {key}={theirs[key]!r} (the run's architecture must "
             "match its checkpoint's)")
    return warnings


def needs_init_from(cfg: Config) -> bool:
    """Whether the run will read train.init_from: it is set and run.dir has no committed
    checkpoint steps of its own (those win: the run resumes from them)."""
    return bool(cfg.train.init_from) and not saved_steps.committed_steps(
        Path(cfg.run.dir) / "checkpoints")


def open_init_source(cfg: Config) -> InitSource:
    """The checkpoint at cfg.train.init_from, its architecture checked against cfg; reads
    config files only. One-line ConfigError for a path that is no checkpoint or a mismatch."""
    given = Path(cfg.train.init_from).expanduser().resolve()
    if not given.is_dir():
        fail(KEY, cfg.train.init_from, None, "no such directory",
             "pass a maxmoe run directory, a `maxmoe convert from-hf` output or an HF model "
             "directory (config.json + *.safetensors)")
    try:
        source = _identify(given)
    except ConversionError as e:
        raise ConfigError(f"{KEY}={given}: {e}") from None
    return dataclasses.replace(source, warnings=tuple(check_architecture(cfg, source)))


def _identify(given: Path) -> InitSource:
    """What kind of checkpoint `given` is, with the config it was saved with."""
    if (given / "params").is_dir() and (given / "config.yaml").is_file():
        return InitSource(given, "converted", load_config([str(given / "config.yaml")])[0])
    if (given / "checkpoints").is_dir() or (given / "state").is_dir():
        run_dir, step_dir = find_checkpoint(given)
        cfg, _ = load_config([str(run_config_file(run_dir, step_dir))])
        return InitSource(given, "run", cfg, step_dir)
    if (given / "config.json").is_file():
        # config_from_hf of its config.json; reads the safetensors headers only, checking the
        # tensor names and shapes
        return InitSource(given, "hf", LeafReader(given).cfg)
    fail(KEY, str(given), None, "is neither a maxmoe checkpoint (params/ or checkpoints/) nor "
         "an HF model directory (config.json)", "point it to one of those")


def load_weights(trainer: Trainer, cfg: Config, source: InitSource) -> dict:
    """{"params", ["buffers"]} of the checkpoint, placed on trainer.abstract_state's
    shardings (each process reads its own devices' shards only)."""
    target = {k: trainer.abstract_state[k] for k in WEIGHTS if k in trainer.abstract_state}
    if source.kind == "hf":
        reader = LeafReader(source.path, cfg)
        return jax.tree_util.tree_map_with_path(
            lambda path, leaf: _from_reader(reader, path_keys(path)[1:], leaf), target)
    layout = target
    if source.cfg.model.scan_layers != cfg.model.scan_layers:
        other = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, scan_layers=source.cfg.model.scan_layers))
        saved = state_layout(other, trainer.mesh).abstract
        layout = {k: saved[k] for k in target}
    if source.kind == "run":
        weights = saved_steps.restore_params(source.step_dir, layout)
    else:
        weights = _restore_converted(source.path / "params", layout)
    if layout is not target:
        weights = {k: relayout(weights[k], target[k], cfg.model.scan_layers) for k in target}
    return weights


def _from_reader(reader: LeafReader, path: tuple, leaf: jax.ShapeDtypeStruct) -> jax.Array:
    """One leaf from HF safetensors: each addressable device's slice read on its own (a
    slice that several devices replicate is read once)."""
    cache: dict[tuple, np.ndarray] = {}

    def read(index: tuple) -> np.ndarray:
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            cache[key] = reader.read(path, index).astype(leaf.dtype, copy=False)
        return cache[key]

    return jax.make_array_from_callback(leaf.shape, leaf.sharding, read)


def _restore_converted(params_dir: Path, layout: dict) -> dict:
    """{"params", ["buffers"]} of a converted checkpoint (one pure dict of both, numpy-saved)
    restored as jax.Arrays onto layout's shardings; leaves layout lacks (MTP) are not read."""
    merged: dict = {}
    for item in layout.values():
        _merge_into(merged, item)
    saved = saved_steps.tree_shapes(ocp.PyTreeCheckpointHandler().metadata(params_dir).tree)
    want = saved_steps.tree_shapes(merged)
    diffs = [f"{k}: saved {saved.get(k, 'absent')}, config builds {v}"
             for k, v in sorted(want.items()) if saved.get(k) != v]
    if diffs:
        raise ConfigError(f"{KEY}={params_dir.parent} holds another param layout than the "
                          f"config builds ({len(diffs)} arrays differ, e.g. {diffs[0]}); "
                          "train with the architecture it was converted with")
    args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(
        sharding=x.sharding, global_shape=x.shape, dtype=x.dtype), merged)
    with ocp.PyTreeCheckpointer() as checkpointer:
        restored = checkpointer.restore(params_dir, args=ocp.args.PyTreeRestore(
            merged, args, partial_restore=True))
    return {k: _pick(restored, item) for k, item in layout.items()}


def _merge_into(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict):
            _merge_into(dst.setdefault(k, {}), v)
        else:
            dst[k] = v


def _pick(tree: dict, like: dict) -> dict:
    """The leaves of `tree` at the paths `like` has."""
    return {k: _pick(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}


def relayout(tree: dict, target: dict, scan_layers: bool) -> dict:
    """Params (or buffers) in the other layer layout -> target's: stacked layer_groups/<g>/...
    [L, ...] <-> per-layer layer_groups/<g>/<layer>/..., placed as target's ShapeDtypeStructs
    say; each group is converted on the devices and its source arrays freed before the next."""
    groups = {}
    for g, group in tree.get("layer_groups", {}).items():
        want = target["layer_groups"][g]
        shardings = jax.tree.map(lambda x: x.sharding, want)
        if scan_layers:  # per-layer -> stacked
            def convert(t):
                return jax.tree.map(lambda *xs: jnp.stack(xs), *[t[j] for j in sorted(t)])
        else:
            count = len(want)

            def convert(t, count=count):
                return {j: jax.tree.map(lambda x, j=j: x[j], t) for j in range(count)}
        groups[g] = jax.jit(convert, out_shardings=shardings)(group)
        jax.tree.map(lambda x: x.delete(), group)
    return dict(tree, layer_groups=groups) if groups else tree


def fresh_rest(trainer: Trainer, cfg: Config) -> dict:
    """The train state's items other than the weights (step, optimizer, guard, loss scale,
    router health) as a new run has them: the run's own init with the weights left out, so
    XLA drops their random initialisation (AdamW's moments are zeros whatever the params)."""
    cfg = resolve_transport(cfg, dict(trainer.mesh.shape))  # as make_trainer builds it
    layout = state_layout(cfg, trainer.mesh)
    shardings = {k: v for k, v in layout.shardings.items() if k not in WEIGHTS}

    def init_rest():
        return {k: v for k, v in layout.init_state().items() if k not in WEIGHTS}

    with use_mesh(trainer.mesh, trainer.rules):
        return jax.jit(init_rest, out_shardings=shardings)()


def initial_state(trainer: Trainer, cfg: Config, source: InitSource,
                  log: Callable[[str], None]) -> Any:
    """A new run's train state whose params and buffers are the checkpoint's; no random
    params are ever made (nor held next to the checkpoint's)."""
    state = dict(fresh_rest(trainer, cfg), **load_weights(trainer, cfg, source))
    log(f"{KEY}: params{' and router bias' if 'buffers' in state else ''} from "
        f"{source.describe()}; optimizer, step and data start fresh")
    return state
