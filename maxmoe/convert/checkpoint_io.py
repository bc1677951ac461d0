"""A converted checkpoint directory: what `convert from-hf` writes and `forward` / `to-hf` read.

    OUT_DIR/config.yaml        the resolved maxmoe config (train with it, or pass it to forward)
    OUT_DIR/params/            Orbax checkpoint of the pure param dict (float32, incl. router bias;
                               no OCDBT, chunks of at most 64 MiB: written chunk by chunk by
                               convert/param_writer.py, read by Orbax's ordinary restore)
    OUT_DIR/hf/config.json     the source config.json (to-hf keeps the fields maxmoe ignores)
    OUT_DIR/hf/tensor_dtypes.json   hub tensor -> dtype on disk (to-hf writes the same dtypes)

A training run directory (run.dir, with checkpoints/<step>/state) is read too: its newest step.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from maxmoe.config import Config
from maxmoe.config_files import load_config, save_config
from maxmoe.convert.param_writer import save_streamed
from maxmoe.hf.names import get_path, leaf_paths
from maxmoe.hf.safetensors_io import ConversionError
from maxmoe.model.transformer import abstract_params
from maxmoe.sharding import make_mesh
from maxmoe.train.evaluate import find_checkpoint
from maxmoe.train.saved_steps import restore_params
from maxmoe.train.step import make_trainer


def write_converted_config(out_dir: Path, cfg: Config, hf_config: dict | None = None,
                           hf_dtypes: dict | None = None) -> None:
    """OUT_DIR/config.yaml and, from a hub checkpoint, OUT_DIR/hf/ (everything but params/)."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out_dir / "config.yaml")
    if hf_config is not None:
        (out_dir / "hf").mkdir(exist_ok=True)
        (out_dir / "hf" / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        (out_dir / "hf" / "tensor_dtypes.json").write_text(json.dumps(hf_dtypes or {}, indent=0))


def save_converted(out_dir: Path, cfg: Config, params: dict, hf_config: dict | None = None,
                   hf_dtypes: dict | None = None) -> None:
    """A converted checkpoint directory from params held in memory (numpy arrays), written
    chunk by chunk like `convert from-hf` writes it (no copy of the model is made)."""
    write_converted_config(out_dir, cfg, hf_config, hf_dtypes)
    shapes = {p: np.shape(x) for p, x in leaf_paths(params)}
    save_streamed(Path(out_dir).resolve() / "params", shapes,
                  lambda path, index: np.asarray(get_path(params, path)[index], np.float32))


def read_converted(ckpt_dir: Path, overrides: list[str] = ()) -> tuple[Config, dict | None, dict]:
    """(config, source HF config or None, hub tensor dtypes) of a converted checkpoint or run."""
    ckpt_dir = Path(ckpt_dir).resolve()
    if not (ckpt_dir / "config.yaml").is_file():
        raise ConversionError(f"{ckpt_dir}: no config.yaml; pass a directory written by "
                              "'maxmoe convert from-hf' or a training run directory")
    cfg, _ = load_config([str(ckpt_dir / "config.yaml")], list(overrides))
    hf_config, dtypes = None, {}
    if (ckpt_dir / "hf" / "config.json").is_file():
        hf_config = json.loads((ckpt_dir / "hf" / "config.json").read_text())
        dtypes = json.loads((ckpt_dir / "hf" / "tensor_dtypes.json").read_text())
    return cfg, hf_config, dtypes


def read_params(ckpt_dir: Path, cfg: Config, paths: list[tuple] | None = None) -> dict:
    """The params as numpy arrays; with `paths` (keys into the param dict) only those, read
    alone from a converted checkpoint (a training run directory restores everything)."""
    ckpt_dir = Path(ckpt_dir).resolve()
    if not (ckpt_dir / "params").is_dir():
        return jax.tree.map(np.asarray, _params_from_run(ckpt_dir, cfg))
    abstract = abstract_params(cfg)
    if paths is not None:
        subtree: dict = {}
        for path in paths:
            node = subtree
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = get_path(abstract, path)
        abstract = subtree
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), abstract)
    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(ckpt_dir / "params", args=ocp.args.PyTreeRestore(
            abstract, restore_args, partial_restore=paths is not None))


def load_converted(ckpt_dir: Path, overrides: list[str] = ()) -> tuple[Config, dict, dict | None, dict]:
    """(config, params as numpy arrays, source HF config or None, hub tensor dtypes)."""
    cfg, hf_config, dtypes = read_converted(ckpt_dir, overrides)
    return cfg, read_params(ckpt_dir, cfg), hf_config, dtypes


def _params_from_run(run_dir: Path, cfg: Config) -> dict:
    """The model variables of the newest committed step of a training run (params + router
    bias), read as train.saved_steps.restore_params reads them: no optimizer state, and nothing
    in the run directory created or deleted (a job may still be saving into it)."""
    if not (run_dir / "checkpoints").is_dir():
        raise ConversionError(f"{run_dir}: neither params/ nor checkpoints/ found; pass a "
                              "converted checkpoint or a training run directory")

    mesh = make_mesh({"data": 1, "fsdp": 1, "pipeline": 1, "expert": 1, "tensor": 1},
                     jax.devices("cpu")[:1])
    trainer = make_trainer(cfg, mesh)
    _, step_dir = find_checkpoint(run_dir)
    state = restore_params(step_dir, trainer.abstract_state)
    merged = nnx.to_pure_dict(nnx.state(nnx.merge(
        trainer.graphdef, state["params"], *([state["buffers"]] if "buffers" in state else []))))
    return merged
