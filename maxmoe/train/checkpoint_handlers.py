"""Orbax and Grain adapters of maxmoe.train.checkpoint: the data iterator's position frozen
for a background save and restored without Grain's JSON tuple trap, and the jax.Array handler
whose failed restore lets its other reads end (and saves shards whole in one process)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp


class IteratorSnapshot:
    """A Grain iterator's position frozen at creation, in the form Grain's handler writes."""

    def __init__(self, iterator: Any):
        state = iterator.get_state()  # DataLoader iterators give bytes, datasets a dict
        self._state = state if isinstance(state, bytes) else json.dumps(state, indent=4).encode()

    def get_state(self) -> bytes:
        return self._state


def restore_iterator(iterator: Any, directory: Path) -> None:
    """Grain's CheckpointRestore, minus its JSON trap: packing states hold tuples.

    grain 0.2.18's concat-then-split packing compares `remainder_slices` with the tuple
    (-1, -1); after a JSON round trip they are lists, it believes a remainder is pending
    and resumes a few rows off. Tuples are put back here.
    """
    path = directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    text = path.read_text()
    if not isinstance(iterator, grain.DatasetIterator):
        iterator.set_state(text.encode())  # DataLoader iterators take their bytes back
        return

    def tuples(obj: dict) -> dict:
        if isinstance(obj.get("remainder_slices"), dict):
            obj["remainder_slices"] = {k: tuple(v) if isinstance(v, list) else v
                                       for k, v in obj["remainder_slices"].items()}
        return obj

    iterator.set_state(json.loads(text, object_hook=tuples))



class ArrayHandler(ocp.type_handlers.ArrayHandler):
    """Orbax's jax.Array handler, except that a restore that fails lets its other reads end.

    Orbax gathers the reads of all arrays in an event loop that it closes as soon as one read
    fails (a corrupt step). The reads still in flight then finish into the closed loop, and
    each prints a traceback ("RuntimeError: Event loop is closed", "Exception ignored in
    <coroutine _read_array_index_and_device_put>") around resume's one-line warning. The
    train state is all jax.Arrays, so every read of a restore runs under this handler.
    """

    async def deserialize(self, infos, args=None):
        before = asyncio.all_tasks()
        try:
            return await super().deserialize(infos, args)
        except Exception:
            # every task started since `before` is a read of this call: none awaits us
            while stragglers := [t for t in asyncio.all_tasks() - before
                                 if t is not asyncio.current_task() and not t.done()]:
                await asyncio.gather(*stragglers, return_exceptions=True)
            raise


def register_array_handler() -> None:
    """Restores and saves jax.Arrays with `ArrayHandler`; in a single process, each shard
    is written whole instead of in replica-parallel parts.

    Orbax defaults to replica-parallel saving off GPU: every replica of a replicated array
    saves 1/R of it, cut out with an eager `lax.slice_in_dim` per replica, which compiles
    once per shape. That spreads writes over hosts in a multi-host job, but with all replicas
    in one process (fake CPU devices) it only costs: the first save of `configs/tiny.yaml`
    compiled ~150 slices while blocking the train loop. Multi-process jobs keep Orbax's
    default."""
    current = ocp.type_handlers.get_type_handler(jax.Array)
    if isinstance(current, ArrayHandler):
        return
    # the override is deliberate: Orbax's absl warning about it would open every command
    quiet = _Without("Type handler registry type")
    logging.getLogger("absl").addFilter(quiet)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, ArrayHandler(
            use_replica_parallel=False if jax.process_count() == 1 else None,
            array_metadata_store=current._array_metadata_store),  # Orbax 0.12: no public getter
            override=True)
    finally:
        logging.getLogger("absl").removeFilter(quiet)


class _Without(logging.Filter):
    """Drops the log records whose message starts with `prefix`."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)
