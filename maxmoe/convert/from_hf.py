"""Hugging Face safetensors -> maxmoe params, one tensor at a time.

The destination arrays (float32, the model once) are allocated up front; each hub tensor is read
memory-mapped, dequantized if FP8, and cast into its slices; the save writes those arrays in
place, so the model never sits in memory twice. Unknown and missing tensors are reported before
anything is read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np

from maxmoe.config import Config
from maxmoe.convert.checkpoint_io import abstract_params, save_converted
from maxmoe.convert.hf_config import config_from_hf, family_of
from maxmoe.convert.names import hub_shape, hub_tensors, hub_to_params, mtp_shared_copies
from maxmoe.convert.safetensors_io import (
    SCALE_SUFFIX,
    ConversionError,
    SafetensorsReader,
    iter_names_with_scales,
)


def read_hf_config(hf_dir: Path) -> dict:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConversionError(f"{hf_dir}: no config.json; point to a Hugging Face model directory")
    return json.loads(path.read_text())


def count_mtp_layers(names: list[str], num_layers: int) -> int:
    """Hub checkpoints hold MTP modules as layers num_layers, num_layers + 1, ..."""
    indices = {int(m.group(1)) for n in names if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    return len([i for i in indices if i >= num_layers])


def read_hf(hf_dir: Path, base: Config | None = None) -> tuple[Config, dict, dict, dict]:
    """(maxmoe config, params as float32 numpy arrays, source config.json, hub tensor dtypes)."""
    hf_config = read_hf_config(hf_dir)
    family = family_of(hf_config)
    reader = SafetensorsReader(hf_dir)
    names = iter_names_with_scales(reader.names())
    mtp_depth = count_mtp_layers(names, hf_config.get("num_hidden_layers", 0))
    cfg = config_from_hf(hf_config, mtp_depth, base)
    expected = {t.name: t for t in hub_tensors(cfg, family)}
    copies = {t.name: t for t in mtp_shared_copies(cfg)}
    unknown = [n for n in names if n not in expected and n not in copies]
    if unknown:
        raise ConversionError(
            f"unknown tensor '{unknown[0]}' in {reader.files[unknown[0]]} ({len(unknown)} unknown "
            f"in all): a {family} model with this config.json has no such tensor; fix config.json "
            "or remove the tensor")
    present = set(names)
    missing = [n for n in expected if n not in present]
    if missing:
        raise ConversionError(
            f"missing tensor '{missing[0]}' ({len(missing)} missing in all): config.json describes "
            f"a {family} model that needs it; add the shard that holds it or fix config.json")
    shapes = abstract_params(cfg)
    params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes)
    dtypes = {}
    for name in names:
        if name in copies:
            continue
        value = reader.get(name)
        tensor = expected[name]
        want = hub_shape(tensor, shapes)
        if value.shape != want:
            raise ConversionError(f"tensor '{name}' has shape {list(value.shape)} but config.json "
                                  f"implies {list(want)}; fix config.json")
        hub_to_params(tensor, value, params)
        dtypes[name] = "BF16" if name + SCALE_SUFFIX in reader.files else reader.dtype_name(name)
    main_of = {t.parts: n for n, t in expected.items()}
    for name, tensor in copies.items():  # must repeat the shared tensor exactly
        if name in present and not np.array_equal(reader.get(name),
                                                  reader.get(main_of[tensor.parts])):
            raise ConversionError(f"tensor '{name}' differs from the main model's; maxmoe shares "
                                  "the MTP embedding and head, so it cannot hold this checkpoint")
        if name in present:
            dtypes[name] = reader.dtype_name(name)
    return cfg, params, hf_config, dtypes


def convert_from_hf(hf_dir: Path, out_dir: Path) -> Config:
    cfg, params, hf_config, dtypes = read_hf(hf_dir)
    save_converted(out_dir, cfg, params, hf_config, dtypes)
    return cfg
