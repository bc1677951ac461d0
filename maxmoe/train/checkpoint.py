"""Async, atomic checkpoints of the train state and the data iterator (Orbax + Grain).

A step directory `<dir>/<step>/` holds the items `state` (a pytree of jax.Arrays: params,
optimizer state, step, router buffers, loss-scale/guard state, whatever the train state
holds), and optionally `data` (the Grain iterator position, one JSON file per process),
`config` (the resolved config, JSON), `meta` (JSON: the data layout the iterator position
belongs to), `metrics` (the eval loss that ranks `keep_best`) and `checksums` (crc32c of every
saved chunk, checked on restore: train/checksums.py). Orbax writes into
`<step>.orbax-checkpoint-tmp-*` and renames it only after the commit, so a crash mid-save
leaves the previous step restorable and the debris is removed on the next start.

`resume()` restores the newest step that reads back; a step that fails is reported and
moved aside to `<dir>.quarantine/` (never deleted), and the next older one is tried. A step
whose saved state has other keys or shapes than this run's (another model config, e.g.
model.scan_layers flipped) is not corrupt: resume stops with a ConfigError naming the
config keys that differ, and moves nothing.

    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    if ckpt.latest_step() is not None:
        state, step = ckpt.restore(abstract_like(state_shapes, state_shardings), data_iter)
    ...
    ckpt.save(step, state, data_iter)            # returns quickly; writes in the background
    ckpt.save(last_step, state, data_iter, force=True)
    ckpt.close()                                  # waits for the last commit
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as ocm

from maxmoe.config import CheckpointConfig
from maxmoe.train import checksums
from maxmoe.train.checkpoint_handlers import (
    IteratorSnapshot,
    register_array_handler,
    restore_iterator,
)
from maxmoe.train.saved_steps import CONFIG, DATA, META, STATE, refuse_other_layout

log = logging.getLogger(__name__)

EVAL_LOSS = "eval_loss"  # the metric keep_best ranks by (lower is better)


@dataclasses.dataclass
class Resumed:
    """What `Checkpointer.resume` found."""
    state: Any
    step: int
    data_iterator: Any  # moved to the saved position if data_restored, else fresh
    data_restored: bool  # False: no iterator state, or saved for another data layout
    quarantined: list[Path]  # step directories that failed to restore and were moved aside
    reasons: list[str] = dataclasses.field(default_factory=list)  # why, one line each


def _eval_loss(metrics: dict) -> float:
    return float(metrics[EVAL_LOSS])


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _all_processes_ok(ok: bool) -> bool:
    """True only if `ok` on every process (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def abstract_like(tree: Any, shardings: Any = None) -> Any:
    """Pytree of jax.ShapeDtypeStruct, each carrying the sharding a restore should produce.

    tree: jax.Arrays (their own shardings are used) or the output of `jax.eval_shape`
    (which has no useful shardings, so pass `shardings`). shardings: a pytree of
    jax.sharding.Sharding matching `tree`, or one Sharding for every leaf (e.g. restore
    everything onto one device for inspection).
    """
    if shardings is None:
        def with_own(x):
            if getattr(x, "sharding", None) is None:
                raise ValueError(f"leaf {x} has no sharding: pass `shardings` to abstract_like "
                                 "(jax.eval_shape results carry none)")
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return jax.tree.map(with_own, tree)
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings),
                            tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


class Checkpointer:
    """Saves every `cfg.every_steps` steps, keeps the `cfg.keep` newest (plus the
    `cfg.keep_best` lowest eval losses), restores with resharding.

    Every process of a multi-host job must make the same calls (Orbax synchronises them).
    """

    def __init__(self, directory: str | Path, cfg: CheckpointConfig):
        # Orbax needs absolute paths; resolving here also makes logs unambiguous.
        self.directory = Path(directory).expanduser().resolve()
        self.cfg = cfg
        options = ocp.CheckpointManagerOptions(
            # The default decision policy also includes InitialSavePolicy (saves the first
            # call whatever its step); we want exactly "every N steps", plus a save when
            # jax.distributed reports a preemption (no-op without it).
            save_decision_policy=ocm.AnySavePolicy([
                ocm.FixedIntervalPolicy(cfg.every_steps),
                ocm.PreemptionCheckpointingPolicy(),
            ]),
            # LatestN (+ BestN), not max_to_keep + best_fn, which can delete the newest step.
            preservation_policy=ocm.AnyPreservationPolicy([
                ocm.LatestN(cfg.keep),
                *([ocm.BestN(get_metric_fn=_eval_loss, reverse=True, n=cfg.keep_best,
                             keep_checkpoints_without_metrics=False)] if cfg.keep_best else []),
            ]),
            # only with keep_best: makes Orbax write the `metrics` item that BestN reads
            best_fn=_eval_loss if cfg.keep_best else None,
            best_mode="min",
            # Removes `*.orbax-checkpoint-tmp-*` left by a kill -9 mid-save.
            cleanup_tmp_directories=True,
            enable_async_checkpointing=cfg.async_save,
            create=True,
        )
        register_array_handler()
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, data_iterator: Any = None, *, force: bool = False,
             config: dict | None = None, meta: dict | None = None,
             metrics: dict | None = None) -> bool:
        """Starts saving `state` (and the iterator position) at `step`; True if a save started.

        Saves when step is a multiple of cfg.every_steps, or always with force=True (e.g. the
        last step, or on SIGTERM). Never overwrites: a step that already exists, or one not
        newer than the latest (without force), is skipped. When this returns, the arrays are
        already copied to host memory, so `state` may be donated to the next train step.
        config / meta: JSON-able dicts stored alongside (the resolved config; the data layout
        `resume` compares). metrics: {"eval_loss": x} ranks the step for cfg.keep_best.
        """
        if not self.cfg.enabled:
            return False
        # Orbax raises StepAlreadyExistsError for force=True on an existing step (e.g. the
        # last step is also a multiple of every_steps); skipping is what a trainer wants.
        if step in self._manager.all_steps():
            return False
        args = {STATE: ocp.args.StandardSave(state)}
        if data_iterator is not None:
            # Orbax may run Grain's handler later in its background thread, when the live
            # iterator has moved on: hand it the position as of now.
            args[DATA] = grain.checkpoint.CheckpointSave(IteratorSnapshot(data_iterator))
        if config is not None:
            args[CONFIG] = ocp.args.JsonSave(config)
        if meta is not None:
            args[META] = ocp.args.JsonSave(meta)
        if self.cfg.checksums:  # hashed now: `state` may be donated once save returns
            args[checksums.ITEM] = checksums.ChecksumsSave(checksums.compute(state))
        if metrics is not None and not self.cfg.keep_best:
            metrics = None  # Orbax writes metrics only when it ranks by them
        return self._manager.save(step, args=ocp.args.Composite(**args), force=force,
                                  metrics=metrics)

    def restore(self, abstract_state: Any, data_iterator: Any = None,
                step: int | None = None) -> tuple[Any, int]:
        """Restores (state, step); step None = the latest. Reshards onto abstract_state's shardings.

        abstract_state: pytree of jax.ShapeDtypeStruct with the TARGET shardings (see
        `abstract_like`); the checkpoint may come from another mesh shape or process count.
        data_iterator: a Grain iterator built exactly like the saved one; it is moved in
        place to the saved position. With cfg.checksums, the step's saved bytes are checked
        first (checksums.check_step, a collective): a mismatch raises ChecksumError.
        """
        # A save from this same manager may still be in flight; restore committed data only.
        self._manager.wait_until_finished()
        steps = self.all_steps()
        if step is None:
            step = steps[-1] if steps else None
        if step is None or step not in steps:
            what = f" for step {step}" if step is not None else ""
            raise FileNotFoundError(
                f"no committed checkpoint{what} in {self.directory} (available steps: "
                f"{steps or 'none'}); start from scratch or point to the right directory")
        if self.cfg.checksums:
            checksums.raise_if_corrupt(self.directory / str(step))
        args = {STATE: ocp.args.StandardRestore(abstract_state)}
        if data_iterator is not None and not (self.directory / str(step) / DATA).is_dir():
            raise ValueError(f"checkpoint {self.directory / str(step)} has no data iterator "
                             "state; restore without data_iterator")
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        if data_iterator is not None:
            restore_iterator(data_iterator, self.directory / str(step) / DATA)
        log.info("restored checkpoint step %d from %s", step, self.directory)
        return restored[STATE], step

    def read_json(self, step: int, item: str) -> dict | None:
        """A JSON item (CONFIG or META) of a committed step; None if the step has none."""
        if not (self.directory / str(step) / item).is_dir():
            return None
        return self._manager.restore(step, args=ocp.args.Composite(
            **{item: ocp.args.JsonRestore()}))[item]

    def resume(self, abstract_state: Any, new_iterator: Callable[[], Any] | None = None,
               meta: dict | None = None, config: dict | None = None) -> Resumed | None:
        """Restores the newest step that reads back; None if there is none (start fresh).

        new_iterator: builds a fresh data iterator; its position is restored only when the
        step's saved `meta` equals `meta` (Grain's state is tied to the process and worker
        counts and the pipeline), else `data_restored` is False and the caller decides (the
        train loop skips `step` batches). A step that fails to restore or to match its checksums
        goes to `<dir>.quarantine/` (why: `reasons`, one line each for the caller to print), and
        the next older step is tried. All processes agree on each outcome, so they resume from
        the same step. A step saved for another layout (`refuse_other_layout`; `config`: this
        run's resolved config) raises ConfigError.
        """
        self._manager.wait_until_finished()
        quarantined, reasons = [], []
        for step in reversed(self.all_steps()):
            refuse_other_layout(self.directory / str(step), abstract_state, config)
            iterator = new_iterator() if new_iterator is not None else None
            try:
                state, _ = self.restore(abstract_state, step=step)
                saved_meta = self.read_json(step, META)
                with_data = (iterator is not None and (self.directory / str(step) / DATA).is_dir()
                             and (saved_meta is None or saved_meta == meta))
                if with_data:
                    restore_iterator(iterator, self.directory / str(step) / DATA)
                error = None
            except Exception as e:  # noqa: BLE001 - any failure to read back = a bad step
                error = e
            if _all_processes_ok(error is None):
                return Resumed(state, step, iterator, with_data, quarantined, reasons)
            target, reason = self._quarantine(step, error)
            quarantined.append(target)
            reasons.append(reason)
        return None

    def _quarantine(self, step: int, error: BaseException | None) -> tuple[Path, str]:
        """Moves a failed step out of the manager's sight, keeping its files: (where, why)."""
        source = self.directory / str(step)
        target = self.directory.with_name(self.directory.name + ".quarantine") / str(step)
        if target.exists():
            target = target.with_name(f"{step}-{int(time.time())}")
        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}" if error else \
            "another process failed to read it"
        log.info("checkpoint %s is corrupt (%s); moved it to %s", source, reason, target)
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            source.rename(target)
        _sync(f"maxmoe_quarantine_{step}")
        self._manager.reload()
        return target, reason

    def reached_preemption(self, step: int) -> bool:
        """True on every process once any one got SIGTERM (needs jax.distributed; else False)."""
        return self._manager.reached_preemption(step)

    def wait(self) -> None:
        """Blocks until every started save is committed (and old steps are deleted)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves, then releases Orbax's threads."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
