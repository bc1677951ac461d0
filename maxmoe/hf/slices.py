"""Slices of maxmoe param leaves read straight from Hugging Face safetensors.

`LeafReader(hf_dir, cfg).read(path, index)` returns `param[path][index]` (float32) as
`from_hf.read_hf` would produce it, but reads only the hub tensors that the slice covers, and of
each only the rows and columns it needs (memory-mapped; FP8 block-scaled weights dequantised on
those rows and columns alone). A process that builds its devices' shards with
`jax.make_array_from_callback(shape, sharding, lambda idx: reader.read(path, idx))` therefore
touches about its share of the checkpoint, never the whole model.

The tensor map is hf/names.py's: a hub tensor fills `param[part.index]` (the stacked
layer / expert it belongs to) of one or more leaves; a linear hub weight [out, in] is the
transposed kernel, its out rows split into `groups` blocks of which a part takes a row range.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from maxmoe.config import Config
from maxmoe.hf.config import config_from_hf, family_of
from maxmoe.hf.names import (
    HubTensor,
    Part,
    hub_shape,
    hub_tensors,
    leaf_paths,
    mtp_shared_copies,
    path_key,
)
from maxmoe.hf.safetensors_io import (
    BLOCK,
    SCALE_SUFFIX,
    ConversionError,
    SafetensorsReader,
    iter_names_with_scales,
)
from maxmoe.model.transformer import abstract_params


def _ranges(index: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, stop) per dim of a basic slice tuple (missing trailing dims: whole)."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    if len(index) != len(shape):
        raise ValueError(f"index {index} has more dims than the leaf's shape {shape}")
    out = []
    for s, n in zip(index, shape, strict=True):
        if not isinstance(s, slice):
            raise ValueError(f"index {index}: only slices are supported (got {s!r})")
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"index {index}: slices must have step 1")
        out.append((start, max(start, stop)))
    return out


def _flat(ranges: list[tuple[int, int]], dims: tuple[int, ...]) -> np.ndarray:
    """Row-major flat indices into `dims` of the box `ranges` (in the box's row-major order)."""
    if not dims:
        return np.zeros(1, np.int64)
    grids = np.meshgrid(*[np.arange(a, b) for a, b in ranges], indexing="ij")
    return np.ravel_multi_index([g.reshape(-1) for g in grids], dims).astype(np.int64)


def _as_index(ids: np.ndarray):
    """A slice where the ids are contiguous (a plain memmap view), else the array."""
    if ids.size and ids[-1] - ids[0] + 1 == ids.size and np.all(np.diff(ids) == 1):
        return slice(int(ids[0]), int(ids[-1]) + 1)
    return ids


class LeafReader:
    """The param leaves of an HF checkpoint directory, read slice by slice.

    cfg: the maxmoe config the leaves are laid out for (model.scan_layers picks stacked or
    per-layer paths; model.mtp_depth below the hub's drops its MTP layers); None derives it
    from config.json (`config_from_hf`, MTP depth counted from the tensor names). Missing
    tensors and shapes config.json does not imply are ConversionErrors here, before any read.
    """

    def __init__(self, hf_dir: str | Path, cfg: Config | None = None):
        self.hf_dir = Path(hf_dir)
        config_path = self.hf_dir / "config.json"
        if not config_path.is_file():
            raise ConversionError(f"{hf_dir}: no config.json; point to a Hugging Face model "
                                  "directory")
        self.hf_config = json.loads(config_path.read_text())
        self.family = family_of(self.hf_config)
        self.files = SafetensorsReader(self.hf_dir)
        names = iter_names_with_scales(self.files.names())
        layers = self.hf_config.get("num_hidden_layers", 0)
        self.hub_mtp_depth = len({int(m.group(1)) for n in names if
                                  (m := re.match(r"model\.layers\.(\d+)\.", n))
                                  and int(m.group(1)) >= layers})
        self.cfg = cfg if cfg is not None else config_from_hf(self.hf_config, self.hub_mtp_depth)
        self._abstract = abstract_params(self.cfg)
        self._shapes = {p: tuple(x.shape) for p, x in leaf_paths(self._abstract)}
        self._shape_of = {path_key(p): s for p, s in self._shapes.items()}
        self._parts: dict[tuple[str, ...], list[tuple[HubTensor, Part]]] = {}
        self._check(names)

    def _check(self, names: list[str]) -> None:
        """Indexes the tensor map by leaf; missing tensors and wrong shapes are errors."""
        expected = hub_tensors(self.cfg, self.family)
        present = set(names)
        missing = [t.name for t in expected if t.name not in present]
        if missing:
            raise ConversionError(
                f"{self.hf_dir}: missing tensor '{missing[0]}' ({len(missing)} missing in all): "
                f"the {self.family} model the config describes needs it; add the shard that "
                "holds it or fix config.json / the run's model config")
        for tensor in expected:
            want = hub_shape(tensor, self._abstract)
            if self.files.shape(tensor.name) != want:
                raise ConversionError(
                    f"tensor '{tensor.name}' has shape {list(self.files.shape(tensor.name))} but "
                    f"the config implies {list(want)}; fix config.json or the run's model config")
            for part in tensor.parts:
                self._parts.setdefault(path_key(part.path), []).append((tensor, part))
        known = {t.name for t in expected} | {t.name for t in mtp_shared_copies(self.cfg)}
        first_dropped = self.cfg.model.num_layers + self.cfg.model.mtp_depth
        unknown = [n for n in names if n not in known and not _in_layers_from(n, first_dropped)]
        if unknown:
            raise ConversionError(
                f"unknown tensor '{unknown[0]}' in {self.files.files[unknown[0]]} "
                f"({len(unknown)} unknown in all): a {self.family} model with this config has "
                "no such tensor; fix config.json or the run's model config")

    def shapes(self) -> dict[tuple, tuple[int, ...]]:
        """{param path: shape} of every leaf (paths as in the pure param dict)."""
        return dict(self._shapes)

    def read(self, path: tuple, index: tuple = ()) -> np.ndarray:
        """param[path][index] as float32: index is a tuple of step-1 slices (what
        jax.make_array_from_callback passes), missing trailing dims meaning whole."""
        key = path_key(path)
        shape = self._shape_of.get(key)
        if shape is None:
            raise KeyError(f"no param leaf {path} in this model")
        ranges = _ranges(index, shape)
        out = np.zeros([b - a for a, b in ranges], np.float32)
        for tensor, part in self._parts.get(key, []):
            k = len(part.index)
            if not all(a <= i < b for i, (a, b) in zip(part.index, ranges[:k], strict=True)):
                continue
            where = tuple(i - a for i, (a, _) in zip(part.index, ranges[:k], strict=True))
            out[where] = self._read_part(tensor, part, ranges[k:], shape[k:])
        return out

    def _read_part(self, tensor: HubTensor, part: Part, ranges: list[tuple[int, int]],
                   sub_shape: tuple[int, ...]) -> np.ndarray:
        """The box `ranges` of one part's sub-array (its leaf at part.index) from its tensor."""
        box = tuple(b - a for a, b in ranges)
        if not tensor.linear:
            value = self.files.get(tensor.name).reshape(sub_shape)  # a view: nothing read yet
            return np.asarray(value[tuple(slice(a, b) for a, b in ranges)], np.float32)
        d = part.in_dims
        cols = _flat(ranges[:d], sub_shape[:d])  # kernel in dims = hub columns
        outs = _flat(ranges[d:], sub_shape[d:])  # kernel out dims = (group, row) blocks
        hub_rows = self.files.shape(tensor.name)[0]
        per_group = hub_rows // part.groups
        first, stop = part.rows if part.rows is not None else (0, per_group)
        width = stop - first
        group, row = np.divmod(outs, width)
        rows = group * per_group + first + row
        block = self._rows_cols(tensor.name, rows, cols)  # [rows, cols]
        return block.T.reshape(box)

    def _rows_cols(self, name: str, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """weight[rows][:, cols] as float32, reading those rows only; FP8 dequantised with
        the scales of their 128x128 blocks (as safetensors_io.dequantize_fp8 does)."""
        value = self.files.raw(name)[_as_index(rows)][:, _as_index(cols)]
        if name + SCALE_SUFFIX not in self.files.files:
            return np.asarray(value, np.float32)
        return dequantize_fp8_block(value, self.files.raw(name + SCALE_SUFFIX), rows, cols)


def dequantize_fp8_block(value: np.ndarray, scale_inv: np.ndarray, rows: np.ndarray,
                         cols: np.ndarray) -> np.ndarray:
    """weight[rows][:, cols] (FP8, given as `value`) -> float32 with the scales of the 128x128
    blocks those rows and columns fall in: equal to dequantize_fp8(weight)[rows][:, cols]."""
    scale = np.asarray(scale_inv, np.float32)
    return value.astype(np.float32) * scale[np.ix_(rows // BLOCK, cols // BLOCK)]


def _in_layers_from(name: str, first: int) -> bool:
    """Whether a hub tensor belongs to a layer with index >= first (MTP layers the config
    drops)."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= first
