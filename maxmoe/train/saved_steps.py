"""Read-only access to saved checkpoint steps: which steps are committed, whether a step was
saved for this run's model layout (keys and shapes from its metadata), and the params-only
restore every reader of a run uses (eval, generate, forward, convert to-hf, init_from). Nothing
here opens a CheckpointManager, so nothing in the directory is created, cleaned or deleted: a
job may be saving into it meanwhile."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from maxmoe.config import ConfigError

# item (sub-directory) names inside a step directory
STATE, DATA, CONFIG, META = "state", "data", "config", "meta"


def committed_steps(directory: str | Path) -> list[int]:
    """The committed steps under a checkpoint directory, oldest first, read from its listing
    alone (Orbax renames a step's tmp directory to the bare number once it is committed)."""
    directory = Path(directory).expanduser().resolve()
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def refuse_other_layout(step_dir: Path, abstract_state: Any, config: dict | None = None) -> bool:
    """Raises ConfigError when a step's saved state has other keys or shapes than
    abstract_state (a dtype change is not one: Orbax casts on restore), naming the config keys
    that differ from `config` where the step saved its config; else True, or False when its
    metadata does not read back (a corrupt step, not a layout: restore reports it). Reads
    metadata only and opens no CheckpointManager."""
    try:
        saved = _saved_shapes(step_dir)
    except Exception:  # noqa: BLE001 - unreadable metadata: a corrupt step, not a layout
        return False
    want = tree_shapes(abstract_state)
    if saved == want:
        return True
    params_first = sorted(saved.keys() | want.keys(), key=lambda k: (k[:7] != "params/", k))
    diffs = _shape_diffs(saved, want, params_first, "now")
    what = f"{len(diffs)} arrays differ, e.g. {diffs[0]}"
    where = ""
    if (step_dir / CONFIG).is_dir():
        where = f" (its values are in {step_dir / CONFIG})"
        if config is not None:
            saved_config = ocp.JsonCheckpointHandler().restore(step_dir / CONFIG)
            keys = [f"{k} (saved {v!r}, now {now!r})" for k, (v, now) in
                    _config_diff(saved_config, config).items() if not k.startswith("run.")]
            if keys:
                what = f"config keys differ: {', '.join(keys[:6])}; {what}"
    raise ConfigError(f"checkpoint {step_dir} was saved for another model layout than this "
                      f"config builds ({what}); resume with the config it was saved "
                      f"with{where}, or set run.dir to a new directory")


def check_resumable(directory: str | Path, abstract_state: Any, config: dict) -> None:
    """Raises the ConfigError `Checkpointer.resume` would raise for a step saved for another
    layout, before anything is written: the committed steps newest first, up to the first whose
    layout agrees. Read-only (no manager: nothing is created, cleaned or moved)."""
    directory = Path(directory).expanduser().resolve()
    for step in reversed(committed_steps(directory)):
        if refuse_other_layout(directory / str(step), abstract_state, config):
            return  # of this layout: resume starts here (an unreadable step: the next older)


def restore_params(step_dir: str | Path, abstract_state: Any) -> dict:
    """{"params", and "buffers" where the state has them} of one committed step directory,
    placed as abstract_state's shardings say (resharding like `Checkpointer.restore`).

    Reads those arrays only (no optimizer state: a third of the state's bytes with Adam) and
    opens no CheckpointManager, so it creates and deletes nothing in the directory (a job may
    be saving into it). A saved layout other than abstract_state's raises a one-line
    ConfigError naming the first array that differs."""
    step_dir = Path(step_dir).expanduser().resolve()
    wanted = {k: abstract_state[k] for k in ("params", "buffers") if k in abstract_state}
    try:
        saved = _saved_shapes(step_dir)
    except Exception as e:  # noqa: BLE001 - any unreadable metadata: not a checkpoint step
        raise ConfigError(f"checkpoint {step_dir}: its state metadata does not read back "
                          f"({type(e).__name__}); pass a committed checkpoints/<step> folder"
                          ) from None
    want = tree_shapes(wanted)
    diffs = _shape_diffs(saved, want, sorted(want), "config builds")
    if diffs:
        raise ConfigError(f"checkpoint {step_dir} holds another model layout than the config "
                          f"builds ({len(diffs)} arrays differ, e.g. {diffs[0]}); evaluate with "
                          "the config it was trained with (no model.* overrides)")
    restore_args = ocp.checkpoint_utils.construct_restore_args(wanted)
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            return checkpointer.restore(step_dir / STATE, args=ocp.args.PyTreeRestore(
                item=wanted, restore_args=restore_args, partial_restore=True))
    except Exception:
        if not _vanishes(step_dir / STATE):
            raise
        # the job's checkpoint.keep deleted the step under the reader: say so, read nothing
        raise ConfigError(f"checkpoint {step_dir} was deleted while it was read (the training "
                          "job keeps only its newest steps); run again to read the newest "
                          "one") from None


def _vanishes(path: Path, seconds: float = 5.0) -> bool:
    """Whether `path` is gone, or goes within `seconds` (a deletion in progress)."""
    deadline = time.monotonic() + seconds
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not path.exists()


def _saved_shapes(step_dir: Path) -> dict[str, tuple]:
    """`_shapes` of a step directory's saved state, from its metadata (no array is read);
    raises whatever Orbax raises when the metadata does not read back."""
    return tree_shapes(ocp.StandardCheckpointHandler().metadata(step_dir / STATE).tree)


def _shape_diffs(saved: dict[str, tuple], want: dict[str, tuple], keys, now: str) -> list[str]:
    """One line per key of `keys` (in order) whose shapes differ: key, saved shape, and
    `now` (what names the current side) with its shape."""
    return [f"{k}: saved {saved.get(k, 'absent')}, {now} {want.get(k, 'absent')}"
            for k in keys if saved.get(k) != want.get(k)]


def tree_shapes(tree) -> dict[str, tuple]:
    """{"params/layer_groups/0/...": shape} of a state or its saved metadata."""
    def key(path):  # dict keys, sequence indices, namedtuple fields: saved as strings
        return "/".join(str(next((getattr(k, a) for a in ("key", "idx", "name")
                                  if hasattr(k, a)), k)) for k in path)
    return {key(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _config_diff(saved: dict, now: dict, prefix: str = "") -> dict[str, tuple]:
    """{dotted key: (saved, now)} for every leaf that differs between two resolved configs."""
    out = {}
    for k in sorted(saved.keys() | now.keys()):
        a, b = saved.get(k), now.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(_config_diff(a, b, f"{prefix}{k}."))
        elif a != b:
            out[f"{prefix}{k}"] = (a, b)
    return out
