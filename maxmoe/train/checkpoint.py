"""Async, atomic checkpoints of the train state and the data iterator (Orbax + Grain).

A step directory `<dir>/<step>/` holds two items: `state` (a pytree of jax.Arrays) and,
optionally, `data` (the Grain iterator position, one JSON file per process). Orbax writes
into `<step>.orbax-checkpoint-tmp-*` and renames it only after the commit, so a crash
mid-save leaves the previous step restorable and the debris is removed on the next start.

    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    if ckpt.latest_step() is not None:
        state, step = ckpt.restore(abstract_like(state_shapes, state_shardings), data_iter)
    ...
    ckpt.save(step, state, data_iter)            # returns quickly; writes in the background
    ckpt.save(last_step, state, data_iter, force=True)
    ckpt.close()                                  # waits for the last commit
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocm

from maxmoe.config import CheckpointConfig

log = logging.getLogger(__name__)

STATE, DATA = "state", "data"  # item (sub-directory) names inside a step directory


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
    """Saves every `cfg.every_steps` steps, keeps the `cfg.keep` newest, restores with resharding.

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
            # LatestN, not max_to_keep (+best_fn), which can delete the newest step.
            preservation_policy=ocm.LatestN(cfg.keep),
            # Removes `*.orbax-checkpoint-tmp-*` left by a kill -9 mid-save.
            cleanup_tmp_directories=True,
            enable_async_checkpointing=cfg.async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, data_iterator: Any = None, *, force: bool = False) -> bool:
        """Starts saving `state` (and the iterator position) at `step`; True if a save started.

        Saves when step is a multiple of cfg.every_steps, or always with force=True (e.g. the
        last step, or on SIGTERM). Never overwrites: a step that already exists, or one not
        newer than the latest (without force), is skipped. When this returns, the arrays are
        already copied to host memory, so `state` may be donated to the next train step.
        """
        if not self.cfg.enabled:
            return False
        # Orbax raises StepAlreadyExistsError for force=True on an existing step (e.g. the
        # last step is also a multiple of every_steps); skipping is what a trainer wants.
        if step in self._manager.all_steps():
            return False
        args = {STATE: ocp.args.StandardSave(state)}
        if data_iterator is not None:
            # The iterator position is read synchronously inside this call (Grain's handler
            # is not async), so advancing the iterator afterwards is safe.
            args[DATA] = grain.checkpoint.CheckpointSave(data_iterator)
        return self._manager.save(step, args=ocp.args.Composite(**args), force=force)

    def restore(self, abstract_state: Any, data_iterator: Any = None,
                step: int | None = None) -> tuple[Any, int]:
        """Restores (state, step); step None = the latest. Reshards onto abstract_state's shardings.

        abstract_state: pytree of jax.ShapeDtypeStruct with the TARGET shardings (see
        `abstract_like`); the checkpoint may come from another mesh shape or process count.
        data_iterator: a Grain iterator built exactly like the saved one; it is moved in
        place to the saved position.
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
        args = {STATE: ocp.args.StandardRestore(abstract_state)}
        if data_iterator is not None:
            if not (self.directory / str(step) / DATA).is_dir():
                raise ValueError(f"checkpoint {self.directory / str(step)} has no data iterator "
                                 "state; restore without data_iterator")
            args[DATA] = grain.checkpoint.CheckpointRestore(data_iterator)
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        log.info("restored checkpoint step %d from %s", step, self.directory)
        return restored[STATE], step

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
