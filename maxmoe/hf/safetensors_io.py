"""Safetensors files, single or sharded with an index, read lazily and written tensor by tensor.

Reading memory-maps each file and returns one tensor at a time (no copy until it is used),
including float8 tensors that the `safetensors` numpy binding cannot return (it has no
ml_dtypes). FP8 E4M3 weights with 128x128 block scales (`<name>_scale_inv`, DeepSeek-V3 hub
format) are dequantized here. Writing streams each tensor to its shard as it is produced.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
SCALE_SUFFIX = "_scale_inv"  # DeepSeek FP8: `x.weight` has `x.weight_scale_inv`
BLOCK = 128  # FP8 scale block (rows and columns)


class ConversionError(ValueError):
    """A user mistake or an unusable checkpoint; the CLI prints it as one line and exits 2."""


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsReader:
    """All tensors of a checkpoint directory: `model.safetensors` or an index + shards."""

    def __init__(self, directory: Path):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise ConversionError(f"{directory}: no *.safetensors files; point to a Hugging Face "
                                  "model directory (config.json + model*.safetensors)")
        self.files: dict[str, Path] = {}
        self._entries: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            path = directory / name
            if not path.is_file():
                raise ConversionError(f"{path}: listed in the index but missing; download it")
            header, start = _header(path)
            for tensor, entry in header.items():
                self._entries[tensor] = (path, entry, start)
                self.files[tensor] = path

    def names(self) -> list[str]:
        """Tensor names in file order (the order to stream them in)."""
        return sorted(self._entries, key=lambda n: (str(self._entries[n][0]),
                                                    self._entries[n][1]["data_offsets"][0]))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name][1]["shape"])

    def dtype_name(self, name: str) -> str:
        return self._entries[name][1]["dtype"]

    def raw(self, name: str) -> np.ndarray:
        """The tensor as stored (memory-mapped, read-only)."""
        path, entry, start = self._entries[name]
        dtype = np.dtype(DTYPES[entry["dtype"]])
        begin, end = entry["data_offsets"]
        if end == begin:
            return np.zeros(entry["shape"], dtype)
        data = np.memmap(path, np.uint8, "r", offset=start + begin, shape=(end - begin,))
        return data.view(dtype).reshape(entry["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor's values: as stored (memory-mapped; assigning into float32 arrays casts
        exactly), FP8 block-scaled weights dequantized to float32."""
        scale = name + SCALE_SUFFIX
        if scale in self._entries:
            return dequantize_fp8(self.raw(name), self.raw(scale))
        return self.raw(name)


def dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """weight [out, in] float8, scale_inv [ceil(out/128), ceil(in/128)] -> float32 w * scale."""
    rows, cols = weight.shape
    scale = np.asarray(scale_inv, np.float32)
    full = np.repeat(np.repeat(scale, BLOCK, axis=0), BLOCK, axis=1)[:rows, :cols]
    return weight.astype(np.float32) * full


def write_safetensors(directory: Path, plan: list[tuple[str, tuple[int, ...], str]],
                      produce: Callable[[str], np.ndarray], max_shard_bytes: int) -> list[Path]:
    """Writes tensors (name, shape, dtype name) into shards of at most max_shard_bytes.

    produce(name) returns the tensor, called once per tensor in plan order; each is written
    as soon as it is produced, so one tensor is in memory at a time. One shard is written as
    `model.safetensors`; more get `model-0000i-of-0000n.safetensors` plus
    `model.safetensors.index.json`.
    """
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    size = 0
    for name, shape, dtype in plan:
        nbytes = int(np.prod(shape)) * np.dtype(DTYPES[dtype]).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape, dtype))
        size += nbytes
    n = len(shards)
    paths, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        _write_file(directory / file, shard, produce)
        weight_map.update({name: file for name, _, _ in shard})
        paths.append(directory / file)
    if n > 1:
        total = sum(int(np.prod(s)) * np.dtype(DTYPES[d]).itemsize for _, s, d in plan)
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths


def _write_file(path: Path, tensors: list[tuple[str, tuple[int, ...], str]],
                produce: Callable[[str], np.ndarray]) -> None:
    """One safetensors file: the header (all offsets follow from the shapes), then the data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in tensors:
        nbytes = int(np.prod(shape)) * np.dtype(DTYPES[dtype]).itemsize
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, dtype in tensors:
            value = np.ascontiguousarray(produce(name), DTYPES[dtype])
            assert value.shape == tuple(shape), (name, value.shape, shape)
            f.write(value.reshape(-1).view(np.uint8).data)
            del value  # before the next produce()


def iter_names_with_scales(names: Iterable[str]) -> list[str]:
    """The tensor names without FP8 scale companions (they are consumed with their weight)."""
    names = list(names)
    present = set(names)
    return [n for n in names
            if not (n.endswith(SCALE_SUFFIX) and n[:-len(SCALE_SUFFIX)] in present)]
