"""Hugging Face safetensors -> maxmoe params.

`convert_from_hf` (the CLI's) never holds the model: the checkpoint is written chunk by chunk
(convert/param_writer.py), each chunk read as a slice of its param leaf from the hub tensors it
covers (hf/slices.py's LeafReader, memory-mapped, FP8 dequantized), and N processes
each write their share. `read_hf` returns the whole model as float32 arrays (tests, parity
checks). Unknown and missing tensors are reported before anything is read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from maxmoe.config import Config
from maxmoe.convert.checkpoint_io import write_converted_config
from maxmoe.convert.param_writer import MAX_CHUNK_BYTES, Written, save_streamed
from maxmoe.hf.config import config_from_hf, family_of
from maxmoe.hf.names import (
    hub_shape,
    hub_tensors,
    hub_to_params,
    mtp_shared_copies,
    path_key,
)
from maxmoe.hf.safetensors_io import (
    SCALE_SUFFIX,
    ConversionError,
    SafetensorsReader,
    iter_names_with_scales,
)
from maxmoe.hf.slices import LeafReader
from maxmoe.model.transformer import abstract_params


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
    """(maxmoe config, params as float32 numpy arrays, source config.json, hub tensor dtypes):
    the whole model in memory (tests; `convert_from_hf` streams instead)."""
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
    check_shared_copies(reader, cfg, family)
    shapes = abstract_params(cfg)
    params = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes)
    for name in names:
        if name in copies:
            continue
        tensor = expected[name]
        want = hub_shape(tensor, shapes)
        if reader.shape(name) != want:
            raise ConversionError(f"tensor '{name}' has shape {list(reader.shape(name))} but "
                                  f"config.json implies {list(want)}; fix config.json")
        hub_to_params(tensor, reader.get(name), params)
    dtypes = hub_dtypes(reader, cfg, family)
    return cfg, params, hf_config, dtypes


def hub_dtypes(reader: SafetensorsReader, cfg: Config, family: str) -> dict[str, str]:
    """{hub tensor: dtype on disk} for to-hf (FP8 block-scaled weights come back as BF16),
    the MTP layers' copies of the embedding and head included where present."""
    out = {}
    for tensor in hub_tensors(cfg, family) + mtp_shared_copies(cfg):
        if tensor.name in reader.files:
            scaled = tensor.name + SCALE_SUFFIX in reader.files
            out[tensor.name] = "BF16" if scaled else reader.dtype_name(tensor.name)
    return out


def check_shared_copies(reader: SafetensorsReader, cfg: Config, family: str,
                        block_bytes: int = MAX_CHUNK_BYTES) -> None:
    """The MTP layers' embedding and head must equal the main ones (maxmoe shares them);
    compared in row blocks of about block_bytes, each through a fresh memory map dropped after
    it, so the pages of neither tensor stay resident (they would count as the process's)."""
    main_of = {t.parts: t.name for t in hub_tensors(cfg, family)}
    for tensor in mtp_shared_copies(cfg):
        if tensor.name not in reader.files:
            continue
        main = main_of[tensor.parts]
        shape = reader.shape(tensor.name)
        same = shape == reader.shape(main)
        row_bytes = max(1, reader.raw(tensor.name)[:1].nbytes)
        rows = max(1, block_bytes // row_bytes)
        for r in range(0, shape[0] if same and shape else 0, rows):
            same = np.array_equal(reader.get(tensor.name)[r:r + rows],
                                  reader.get(main)[r:r + rows])
            if not same:
                break
        if not same:
            raise ConversionError(f"tensor '{tensor.name}' differs from the main model's; maxmoe "
                                  "shares the MTP embedding and head, so it cannot hold this "
                                  "checkpoint")


def chunk_orders(shapes: dict[tuple, tuple[int, ...]], cfg: Config,
                 family: str) -> dict[tuple, tuple[int, ...]]:
    """{param path: axes in the order the writer cuts them} so that a chunk reads hub rows:
    stacked (layer, expert) axes first, then a kernel's out axes (hub rows, contiguous on
    disk), then its in axes (hub columns: a column block would touch every row's pages).
    shapes: {param path: shape} of every leaf (LeafReader.shapes, the model built once);
    the result's paths are its keys; leaves no hub weight fills in transpose are left out
    (leading-first)."""
    path_of = {path_key(p): p for p in shapes}
    orders = {}
    for tensor in hub_tensors(cfg, family):
        if not tensor.linear:
            continue
        for part in tensor.parts:
            path = path_of[path_key(part.path)]
            k, d, ndim = len(part.index), part.in_dims, len(shapes[path])
            orders[path] = (*range(k), *range(k + d, ndim), *range(k, k + d))
    return orders


def convert_from_hf(hf_dir: Path, out_dir: Path, *, max_chunk_bytes: int = MAX_CHUNK_BYTES,
                    process_index: int = 0, process_count: int = 1,
                    barrier: Callable[[str], None] = lambda _: None) -> tuple[Config, Written]:
    """Writes OUT_DIR (config.yaml, hf/, params/: checkpoint_io.py's layout) from the HF
    directory; every process of a job calls it with its index and a barrier (save_streamed),
    and writes its share of the chunks. Returns the maxmoe config and what this process wrote."""
    reader = LeafReader(hf_dir)
    cfg, family = reader.cfg, family_of(reader.hf_config)
    check_shared_copies(reader.files, cfg, family, max_chunk_bytes)
    out_dir = Path(out_dir).resolve()
    if process_index == 0:
        write_converted_config(out_dir, cfg, reader.hf_config,
                               hub_dtypes(reader.files, cfg, family))
    shapes = reader.shapes()
    written = save_streamed(out_dir / "params", shapes, reader.read,
                            max_chunk_bytes=max_chunk_bytes, process_index=process_index,
                            process_count=process_count, barrier=barrier,
                            orders=chunk_orders(shapes, cfg, family))
    return cfg, written
