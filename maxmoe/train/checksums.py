"""Content checksums of saved arrays: computed when a step is saved, checked against the bytes on
disk when it is restored or verified (issue 38.5). Orbax checks only the zarr shard index, so a
flipped bit inside an array's data would otherwise restore as if nothing happened.

Owns: the chunk grid (`regions`), the crc32c of each chunk (`compute`, `chunk_crc`), the
`checksums` item of a step (`ChecksumsSave` / its handler: one JSON file per process, written
into the step's tmp directory, so Orbax commits it atomically with the step and no two
processes write one file), and verification (`verify`: every recorded chunk read back from the
saved checkpoint; `check_step`: the same spread over processes, with one agreed verdict).

Chunks are regions in GLOBAL index space (`[[start, stop], ...]` per axis), recorded with their
crc, so they stay valid when the step is restored onto another mesh or process count: a
verifier reads each region from the saved array with TensorStore, whatever its own shards are.
A chunk is a shard of replica 0 as saved (its owner hashes it, so each byte is hashed once per
job), cut along its first axis longer than 1 into pieces of at most MAX_CHUNK_BYTES (a verify
can then be spread over processes). The bytes hashed are the array's own, C order, its saved
dtype. Files: `<item>/process_{i}-of-{n}.json` =
{"algorithm": "crc32c", "process_count": n, "arrays": {name: {"shape", "dtype",
"chunks": [[region, crc], ...]}}}, name = the array's folder in the saved item (Orbax's
dotted key path, e.g. `params.embed.embedding`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import crc32c
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.experimental import multihost_utils

ALGORITHM = "crc32c"  # hardware CRC-32C (SSE4.2 / ARMv8): GB/s, so it costs little in a save
ITEM = "checksums"  # the item's folder in a step directory, beside `state`
CONVERTED_DIR = "_CHECKSUMS"  # inside a converted params/ folder (convert/param_writer.py)
MAX_CHUNK_BYTES = 64 * 2**20  # the largest region one crc covers (and one verifier reads)
HASH_THREADS = min(16, os.cpu_count() or 1)  # a save hashes its chunks on this many threads
LINE_BYTES = 400  # a verdict shared between processes is cut to this many bytes


class ChecksumError(Exception):
    """A saved array's bytes differ from the checksum recorded when it was saved."""


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One recorded chunk whose bytes on disk do not match (or do not read back)."""
    array: str
    region: tuple[tuple[int, int], ...]
    what: str

    def line(self) -> str:
        where = ", ".join(f"{a}:{b}" for a, b in self.region)
        return f"array {self.array} chunk [{where}]: {self.what}"


def chunk_crc(value: np.ndarray) -> int:
    """crc32c of an array's bytes in C order (any dtype, bfloat16 included)."""
    flat = np.ascontiguousarray(value).reshape(-1)
    return crc32c.crc32c(flat.view(np.uint8))


def array_name(path) -> str:
    """The folder Orbax saves a leaf in: its keys (dict keys, indices, fields) joined by dots."""
    return ".".join(str(next((getattr(k, a) for a in ("key", "idx", "name") if hasattr(k, a)), k))
                    for k in path)


def regions(index: tuple[slice, ...], shape: tuple[int, ...], itemsize: int,
            max_bytes: int = MAX_CHUNK_BYTES) -> list[tuple[tuple[int, int], ...]]:
    """The chunks of the block `index` of an array of `shape`: the block cut along its first
    axis longer than 1 into the fewest equal pieces of at most max_bytes (the last may be
    shorter), as global [start, stop) pairs per axis."""
    box = [(s.start or 0, n if s.stop is None else s.stop) for s, n in
           zip(index, shape, strict=True)]
    size = itemsize * math.prod(b - a for a, b in box)
    axis = next((k for k, (a, b) in enumerate(box) if b - a > 1), None)
    if axis is None or size <= max_bytes:
        return [tuple(box)]
    a, b = box[axis]
    step = math.ceil((b - a) / math.ceil(size / max_bytes))
    return [tuple(box[:axis] + [(s, min(s + step, b))] + box[axis + 1:])
            for s in range(a, b, step)]


def compute(state: Any) -> dict:
    """This process's checksums of `state` (a pytree of jax.Arrays): every chunk of each
    replica-0 shard it holds. Synchronous (reads the shards to host): call it before the
    arrays are donated."""
    arrays, views = {}, []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        chunks = []
        for shard in leaf.addressable_shards:
            if shard.replica_id != 0:
                continue  # another device holds the same bytes: hashed there
            data = np.asarray(shard.data)
            origin = [s.start or 0 for s in shard.index]
            for region in regions(shard.index, leaf.shape, data.dtype.itemsize):
                local = tuple(slice(a - o, b - o) for (a, b), o in zip(region, origin,
                                                                      strict=True))
                chunks.append([[list(r) for r in region], None])
                views.append(data[local])
        arrays[array_name(path)] = {"shape": list(leaf.shape), "dtype": str(leaf.dtype),
                                    "chunks": chunks}
    # crc32c releases the GIL on buffers of 32 KiB and more: big chunks hash on all cores
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        crcs = iter(pool.map(chunk_crc, views))
    for entry in arrays.values():
        for chunk in entry["chunks"]:
            chunk[1] = next(crcs)
    return {"algorithm": ALGORITHM, "arrays": arrays}


def write(directory: Path, checksums: dict, process_index: int, process_count: int) -> None:
    """One process's checksums as `directory/process_{i}-of-{n}.json` (its own file)."""
    directory.mkdir(parents=True, exist_ok=True)
    body = dict(checksums, process_count=process_count)
    (directory / f"process_{process_index}-of-{process_count}.json").write_text(json.dumps(body))


def read(directory: Path) -> dict | None:
    """The merged checksums of every process, {name: {"shape", "dtype", "chunks"}}; None when
    `directory` does not exist (saved before checksums). Raises ValueError when a process's
    file is missing or another algorithm wrote them."""
    if not directory.is_dir():
        return None
    files = sorted(directory.glob("process_*-of-*.json"))
    merged: dict[str, dict] = {}
    count = None
    for file in files:
        body = json.loads(file.read_text())
        if body.get("algorithm") != ALGORITHM:
            raise ValueError(f"{file}: checksums by {body.get('algorithm')!r}, not {ALGORITHM}")
        count = body["process_count"]
        for name, entry in body["arrays"].items():
            merged.setdefault(name, dict(entry, chunks=[]))["chunks"] += entry["chunks"]
    want = {f"process_{i}-of-{count}.json" for i in range(count or 1)}
    missing = sorted(want - {f.name for f in files})
    if missing:
        raise ValueError(f"{directory}: checksum files missing: {', '.join(missing)}")
    return merged


def _store(item_dir: Path, name: str, metadata: dict) -> ts.TensorStore:
    """The saved array `name` of an Orbax item (OCDBT or plain zarr, as its _METADATA says),
    opened read-only with no cache, so every read comes from the disk."""
    if metadata.get("use_ocdbt"):
        kvstore = {"driver": "ocdbt", "base": f"file://{item_dir}/", "path": f"{name}/"}
    else:
        kvstore = {"driver": "file", "path": f"{item_dir / name}/"}
    driver = "zarr3" if metadata.get("use_zarr3") else "zarr"
    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    return ts.open({"driver": driver, "kvstore": kvstore}, open=True, read=True,
                   context=context).result()


def verify(item_dir: Path, recorded: dict, process_index: int = 0, process_count: int = 1
           ) -> tuple[list[Mismatch], int]:
    """(mismatches, bytes read) of this process's share of the recorded chunks: every
    `process_count`-th chunk in a fixed order, read from the saved item `item_dir` and hashed.
    A chunk that does not read back is a mismatch too (its `what` says why)."""
    try:
        metadata = json.loads((item_dir / "_METADATA").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{item_dir / '_METADATA'} does not read back ({type(e).__name__})"
                         ) from None
    chunks = sorted((name, tuple(map(tuple, region)), crc)
                    for name, entry in recorded.items() for region, crc in entry["chunks"])
    bad, nbytes, stores = [], 0, {}
    for name, region, crc in chunks[process_index::process_count]:
        try:
            if name not in stores:
                stores[name] = _store(item_dir, name, metadata)
            value = stores[name][tuple(slice(a, b) for a, b in region)].read().result()
            got = chunk_crc(value)
            nbytes += value.nbytes
        except Exception as e:  # noqa: BLE001 - an unreadable chunk is a failed check
            bad.append(Mismatch(name, region, f"does not read back ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:160]})"))
            continue
        if got != crc:
            bad.append(Mismatch(name, region, f"{ALGORITHM} {got:08x} on disk, {crc:08x} "
                                "when saved"))
    return bad, nbytes


def check_step(step_dir: Path) -> str | None:
    """Verifies a step's `state` against its `checksums` item, the chunks spread over the
    processes; returns one line naming the first bad array and chunk that any process found
    (the same line on every process), or None when all match or the step has no checksums.
    A collective (every process must call it); never raises, so none can leave it early."""
    line, what = None, "its checksums"
    try:
        recorded = read(step_dir / ITEM)
        what = "its state"
        if recorded is not None:
            bad, _ = verify(step_dir / "state", recorded, jax.process_index(),
                            jax.process_count())
            line = bad[0].line() if bad else None
    except Exception as e:  # noqa: BLE001 - an unreadable step is not trusted
        line = f"{what} does not read back ({type(e).__name__}: {str(e)[:200]})"
    if jax.process_count() == 1:
        return line
    mine = np.zeros(LINE_BYTES, np.uint8)
    encoded = (line or "").encode()[:LINE_BYTES]
    mine[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    found = [bytes(row).rstrip(b"\0").decode(errors="replace")
             for row in np.asarray(multihost_utils.process_allgather(mine))]
    return next((f for f in found if f), None)


class ChecksumsHandler(ocp.CheckpointHandler):
    """Orbax handler of the `checksums` item: each process writes its own file (`write`)."""

    def save(self, directory, args: ChecksumsSave) -> None:
        write(Path(directory), args.checksums, jax.process_index(), jax.process_count())

    def restore(self, directory, args: ChecksumsRestore | None = None) -> dict | None:
        return read(Path(directory))

    def metadata(self, directory) -> None:
        return None

    def finalize(self, directory) -> None:
        pass

    def close(self) -> None:
        pass


@ocp.args.register_with_handler(ChecksumsHandler, for_save=True)
@dataclasses.dataclass
class ChecksumsSave(ocp.args.CheckpointArgs):
    checksums: dict  # `compute`'s output for this process


@ocp.args.register_with_handler(ChecksumsHandler, for_restore=True)
@dataclasses.dataclass
class ChecksumsRestore(ocp.args.CheckpointArgs):
    pass


@dataclasses.dataclass
class Report:
    """What `verify_item` found in one saved item (a step's state, or converted params)."""
    item: Path
    arrays: int = 0
    chunks: int = 0
    nbytes: int = 0  # bytes read back and hashed
    bad: list[Mismatch] | None = None  # None: saved before checksums existed (not checked)


def verify_item(item_dir: Path, checksums_dir: Path) -> Report:
    """Reads back and hashes every chunk recorded in `checksums_dir` (one process: all of
    them); a missing or unreadable checksum file or array is reported as a Mismatch."""
    report = Report(item_dir)
    try:
        recorded = read(checksums_dir)
        if recorded is None:
            return report
        report.bad, report.nbytes = verify(item_dir, recorded)
    except Exception as e:  # noqa: BLE001 - an unreadable step is a failed check, not a crash
        report.bad = [Mismatch(checksums_dir.name, (), f"does not read back "
                               f"({type(e).__name__}: {str(e).splitlines()[0][:200]})")]
        return report
    report.arrays = len(recorded)
    report.chunks = sum(len(e["chunks"]) for e in recorded.values())
    return report


def items_under(path: Path) -> list[tuple[Path, Path]]:
    """(item, checksums folder) of every committed checkpoint at `path`: a run directory (each
    committed step of its checkpoints/), a checkpoints directory, one step folder, or a
    converted checkpoint (`convert from-hf`'s OUT_DIR or its params/); [] when none."""
    path = Path(path).expanduser().resolve()
    if (path / "state" / "_METADATA").is_file():  # a step folder
        return [(path / "state", path / ITEM)]
    if (path / "params" / "_METADATA").is_file():  # a converted OUT_DIR
        path = path / "params"
    if (path / "_METADATA").is_file():  # a converted params/ folder
        return [(path, path / CONVERTED_DIR)]
    steps = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if not steps.is_dir():
        return []
    # a committed step is renamed to its bare number; `<step>.orbax-checkpoint-tmp-*` is not
    return [(steps / d.name / "state", steps / d.name / ITEM)
            for d in sorted(steps.iterdir(), key=lambda d: int(d.name) if d.name.isdigit() else 0)
            if d.name.isdigit() and (d / "state").is_dir()]


def raise_if_corrupt(step_dir: Path) -> None:
    """`check_step`, raising ChecksumError with its line on every process when a chunk fails."""
    line = check_step(step_dir)
    if line is not None:
        raise ChecksumError(line)
