"""Writes a param tree as an Orbax checkpoint directory chunk by chunk, from a producer, with
TensorStore: no leaf is ever whole in memory, and N processes each write their share.

The directory is the layout Orbax's `PyTreeCheckpointHandler(use_ocdbt=False)` writes for a
pytree of numpy arrays (what `save_converted` wrote before): one zarr v2 array per leaf in a
folder named by its dotted path (`layer_groups.1.mlp.gate/.zarray` + `0.0.0.0`-style chunk
files, zstd level 1, float32), `_METADATA` (the tree), `_CHECKPOINT_METADATA` and
`commit_success.txt`, plus `_CHECKSUMS/` (crc32c of every chunk, one JSON file per process:
train/checksums.py, checked by `maxmoe ckpt verify`). Orbax's ordinary restore reads it
unchanged (`read_params`); only the chunk shapes differ from Orbax's choice, which restore
takes from each `.zarray`. OCDBT is not
used: its per-process B-trees must be merged by one process at the end, and that merge is
Orbax's private code; plain zarr lets every process write whole chunk files on its own.

Each chunk cuts a leaf along some axes (by default leading ones: one layer's expert, a row block
of the embedding; the caller may name others, e.g. the LM head's vocabulary axis), so a chunk
is the slice `produce(path, index)` returns and the unit one process writes: no two
processes ever touch one chunk file. At most `IN_FLIGHT + 1` produced chunks are alive per
process (TensorStore adopts each as the chunk's buffer, no copy).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import itertools
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorstore as ts

from maxmoe.hf.safetensors_io import ConversionError
from maxmoe.train import checksums

MAX_CHUNK_BYTES = 64 * 2**20  # Orbax's chunk_byte_size that save_converted used
IN_FLIGHT = 1  # chunks being compressed and written while the next one is produced
DTYPE = np.dtype(np.float32)  # every converted param is saved as float32
M_ARENA_MAX = -8  # glibc's mallopt parameter
try:
    _LIBC = ctypes.CDLL("libc.so.6")  # glibc; another C library: no arena limit
    _LIBC.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
except (OSError, AttributeError):
    _LIBC = None
Produce = Callable[[tuple, tuple[slice, ...]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Chunk:
    path: tuple  # keys into the param dict
    index: tuple[slice, ...]  # the chunk's slice of the leaf
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Written:
    """What one process wrote: its chunks, of how many in all, and their float32 bytes."""
    chunks: int
    total: int
    nbytes: int


def chunk_shape(shape: tuple[int, ...], itemsize: int, max_bytes: int,
                order: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The chunk of an array `shape`, at most max_bytes (or one element): axes are cut in
    `order` (default: leading first), each to 1 while the axes after it alone exceed
    max_bytes, the next one to fit, the rest left whole; a cut takes the fewest pieces that
    fit, of even length (ceil(n / pieces))."""
    order = tuple(range(len(shape))) if order is None else tuple(order)
    out = list(shape)
    for j, k in enumerate(order):
        rest = itemsize * math.prod(shape[a] for a in order[j + 1:])
        if shape[k] * rest <= max_bytes:
            break
        fit = max(1, max_bytes // rest)
        out[k] = math.ceil(shape[k] / math.ceil(shape[k] / fit))
        if fit > 1:
            break
    return tuple(out)


def leaf_chunks(path: tuple, shape: tuple[int, ...], chunks: tuple[int, ...]) -> list[Chunk]:
    """Every chunk of one leaf of `shape` cut into `chunks` (chunk_shape's), in C order of
    the chunk grid."""
    starts = [range(0, n, c) for n, c in zip(shape, chunks, strict=True)]
    out = []
    for corner in itertools.product(*starts):
        index = tuple(slice(s, min(s + c, n)) for s, c, n in zip(corner, chunks, shape,
                                                                strict=True))
        out.append(Chunk(path, index, DTYPE.itemsize * math.prod(i.stop - i.start
                                                                  for i in index)))
    return out


def assign(chunks: list[Chunk], count: int) -> list[list[Chunk]]:
    """Chunks per process: largest first to the least loaded (ties: lowest process), each
    share kept in the input order. Deterministic, so every process computes the same split."""
    load = [0] * count
    share: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(range(len(chunks)), key=lambda i: (-chunks[i].nbytes, i)):
        p = min(range(count), key=lambda p: (load[p], p))
        load[p] += chunks[i].nbytes
        share[p].append(i)
    return [[chunks[i] for i in sorted(s)] for s in share]


def array_name(path: tuple) -> str:
    """The folder of a leaf, as Orbax names it: its keys joined with dots."""
    return ".".join(str(k) for k in path)


def _spec(directory: Path, path: tuple, chunks: tuple[int, ...], shape: tuple[int, ...]
          ) -> dict:
    """TensorStore spec of one leaf, the zarr v2 metadata Orbax writes (tests compare them)."""
    return {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": str(directory / array_name(path))},
        "recheck_cached_data": False,
        "recheck_cached_metadata": False,
        "store_data_equal_to_fill_value": True,
        "metadata": {"shape": list(shape), "chunks": list(chunks), "dtype": DTYPE.str,
                     "compressor": {"id": "zstd", "level": 1}, "dimension_separator": ".",
                     "fill_value": None, "filters": None, "order": "C"},
    }


def _context() -> ts.Context:
    """No chunk cache (a written chunk is dropped once on disk), and bounded copy threads."""
    return ts.Context({"cache_pool": {"total_bytes_limit": 0},
                       "data_copy_concurrency": {"limit": max(1, min(8, os.cpu_count() or 1))}})


def tree_metadata(paths: list[tuple]) -> dict:
    """Orbax's `_METADATA` of a pure dict of numpy arrays with these leaf paths."""
    tree = {str(tuple(str(k) for k in path)): {
        "key_metadata": [{"key": str(k), "key_type": 2} for k in path],  # 2: a dict key
        "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False}}
        for path in paths}
    return {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True, "custom_metadata": None}


@contextlib.contextmanager
def _one_arena():
    """Inside: threads share glibc's existing malloc arenas (each TensorStore thread would
    otherwise keep the chunk buffers it freed in an arena of its own, and the resident size
    creep up by a chunk per thread); after: glibc's default limit, 8 per core, again."""
    if _LIBC is not None:
        _LIBC.mallopt(M_ARENA_MAX, 1)
    try:
        yield
    finally:
        if _LIBC is not None:
            _LIBC.mallopt(M_ARENA_MAX, 8 * (os.cpu_count() or 1))


def _write_share(directory: Path, specs: dict[tuple, dict], mine: list[Chunk],
                 produce: Produce) -> dict:
    """Writes this process's chunks: produce one, hand it to TensorStore (which keeps the
    array as the chunk's buffer instead of copying it), produce the next while at most
    IN_FLIGHT writes are being compressed and written. Returns their checksums (the
    `arrays` of train/checksums.py's format: a chunk is hashed as produced, before it is
    written, and `maxmoe ckpt verify` reads it back)."""
    context = _context()
    arrays: dict[tuple, ts.TensorStore] = {}
    sums: dict[str, dict] = {}
    pending: collections.deque = collections.deque()
    for chunk in mine:
        if chunk.path not in arrays:
            arrays[chunk.path] = ts.open(specs[chunk.path], open=True, context=context).result()
        value = np.ascontiguousarray(produce(chunk.path, chunk.index), DTYPE)
        want = tuple(i.stop - i.start for i in chunk.index)
        if value.shape != want:
            raise ValueError(f"produce({chunk.path}, {chunk.index}) returned shape "
                             f"{value.shape}, not {want}")
        entry = sums.setdefault(array_name(chunk.path), {
            "shape": specs[chunk.path]["metadata"]["shape"], "dtype": DTYPE.name, "chunks": []})
        entry["chunks"].append([[[i.start, i.stop] for i in chunk.index],
                                checksums.chunk_crc(value)])
        pending.append(arrays[chunk.path][chunk.index].write(
            value, can_reference_source_data_indefinitely=True))
        del value
        while len(pending) > IN_FLIGHT:
            pending.popleft().result()
    for future in pending:
        future.result()
    return sums


def save_streamed(directory: Path, shapes: dict[tuple, tuple[int, ...]], produce: Produce, *,
                  max_chunk_bytes: int = MAX_CHUNK_BYTES,
                  orders: dict[tuple, tuple[int, ...]] | None = None, process_index: int = 0,
                  process_count: int = 1, barrier: Callable[[str], None] = lambda _: None
                  ) -> Written:
    """Writes the float32 leaves `shapes` ({path: shape}, in tree order) to the Orbax
    checkpoint `directory` (replaced if it exists), each chunk from produce(path, index).

    orders: {path: axes in the order they are cut} for leaves whose reads are cheapest along
    other axes than the leading ones (chunk_shape). Run by every process of a job with its
    index and a barrier(name) that returns once all processes called it: process 0 creates
    the arrays in `<directory>.tmp`, each process writes its share of the chunks (`assign`),
    then process 0 writes the metadata and renames the folder into place, so `directory`
    only ever appears complete. The folder must be on a file system all processes see."""
    with _one_arena():  # from the start: TensorStore's threads take their arenas at first use
        return _save(Path(directory).resolve(), shapes, produce, max_chunk_bytes, orders or {},
                     process_index, process_count, barrier)


def _save(directory: Path, shapes: dict, produce: Produce, max_chunk_bytes: int, orders: dict,
          process_index: int, process_count: int, barrier: Callable[[str], None]) -> Written:
    """save_streamed's steps (see there)."""
    tmp = directory.with_name(directory.name + ".tmp")
    specs, chunks = {}, []
    for path, shape in shapes.items():
        grid = chunk_shape(tuple(shape), DTYPE.itemsize, max_chunk_bytes, orders.get(path))
        specs[path] = _spec(tmp, path, grid, tuple(shape))
        chunks += leaf_chunks(path, tuple(shape), grid)
    if process_index == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        context = _context()
        for future in [ts.open(spec, create=True, context=context) for spec in specs.values()]:
            future.result()
    barrier("maxmoe-convert-created")
    if not tmp.is_dir():
        raise ConversionError(f"{tmp}: process 0 created it but process {process_index} does "
                              "not see it; write to a file system every process mounts")
    mine = assign(chunks, process_count)[process_index]
    sums = _write_share(tmp, specs, mine, produce)
    # each process its own file, inside the folder the commit renames (published with it)
    checksums.write(tmp / checksums.CONVERTED_DIR, {"algorithm": checksums.ALGORITHM,
                                                    "arrays": sums}, process_index, process_count)
    barrier("maxmoe-convert-written")
    if process_index == 0:
        _commit(tmp, directory, list(shapes))
    barrier("maxmoe-convert-committed")
    return Written(len(mine), len(chunks), sum(c.nbytes for c in mine))


def _commit(tmp: Path, directory: Path, paths: list[tuple]) -> None:
    """The metadata files Orbax writes last, then the rename that publishes the checkpoint."""
    now = time.time_ns()
    (tmp / "_METADATA").write_text(json.dumps(tree_metadata(paths)))
    (tmp / "_CHECKPOINT_METADATA").write_text(json.dumps({
        "item_handlers": "orbax.checkpoint._src.handlers.pytree_checkpoint_handler."
                         "PyTreeCheckpointHandler",
        "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": now,
        "commit_timestamp_nsecs": now, "custom_metadata": {}}))
    (tmp / "commit_success.txt").write_text(f"Checkpoint commit was successful to {directory}")
    if directory.exists():
        shutil.rmtree(directory)
    tmp.rename(directory)
