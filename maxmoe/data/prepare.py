"""`maxmoe data prepare`: raw documents -> cleaned, deduplicated, tokenized ArrayRecord shards,
on datatrove's executors (local processes, a Ray cluster, or Slurm job arrays).

stages.py builds the pipelines (clean, exact and MinHash dedup resolved across all tasks,
write, manifest); executors.py runs each one with the chosen executor. This module checks the
options, claims the output folder (a rerun with the same settings resumes it) and runs the
stages in order. With Slurm the stages are submitted as dependent job arrays and this returns
at once; the manifest appears when the last job finishes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

from maxmoe.config import ConfigError
from maxmoe.data import shards
from maxmoe.data.executors import LaunchOptions, executor_for, slurm_submission, start_ray
from maxmoe.data.filters import FilterOptions
from maxmoe.data.sources import InputOptions, list_inputs
from maxmoe.data.stages import MAX_TASKS
from maxmoe.data.tokenizer import open_tokenizer


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
    inputs: InputOptions = InputOptions()
    filters: FilterOptions = FilterOptions()
    exact_dedup: bool = True  # drop documents whose normalised text another document has
    near_dedup: bool = True  # drop MinHash near-duplicates (one survivor per cluster)
    decontaminate: tuple[str, ...] = ()  # eval files: drop docs sharing a 13-gram with them
    validation_fraction: float = 0.01  # share of documents held out, chosen by content hash
    seed: int = 0  # seeds the validation choice
    tasks: int = 1  # tasks of each per-file stage = output shards; output depends on it
    launch: LaunchOptions = LaunchOptions()  # where the tasks run (not part of the output)

    def check(self) -> None:
        self.filters.check()
        self.launch.check()
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ConfigError(f"option --validation-fraction {self.validation_fraction}: must "
                              "be in [0, 1); use e.g. 0.01")
        if not 1 <= self.tasks <= MAX_TASKS:
            raise ConfigError(f"option --tasks {self.tasks}: must be in [1, {MAX_TASKS}]; use "
                              "about one per core of the cluster, or the number of input files "
                              "if fewer")
        for path in self.decontaminate:
            if not os.path.isfile(path):
                raise ConfigError(f"option --decontaminate {path!r}: no such file; name the "
                                  "evaluation texts (text, JSON lines or Parquet files)")


def prepare(inputs: list[str], tokenizer_dir: str, out: str,
            options: PrepareOptions = PrepareOptions(), overwrite: bool = False) -> dict | None:
    """Runs (or resumes) the preparation of `inputs` into `out`; returns the manifest, or
    None when the stages were handed to Slurm (submitted, or written with --dry-run)."""
    # late: the tests replace stages.build_stages to add a step to a stage
    from maxmoe.data.stages import build_stages

    options.check()
    files = list_inputs(inputs)
    # a SentencePiece model (`maxmoe data tokenizer` trains one) or a Hugging Face folder
    tokenizer = open_tokenizer(tokenizer_dir, f"option --tokenizer {tokenizer_dir!r}")
    directory = Path(out).expanduser().resolve()
    settings = {
        "inputs": list(inputs),
        "options": _settings_of(options),
        "tokenizer": {"file": f"{shards.TOKENIZER_DIR}/{Path(tokenizer.path).name}",
                      "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size},
        # task k reads files[k::tasks]: a changed input list cannot resume
        "files": [[f, os.path.getsize(f)] for f in files],
    }
    _claim_directory(directory, settings, overwrite)
    tokenizer.save(directory / shards.TOKENIZER_DIR)
    launch = options.launch
    if launch.executor == "ray":
        start_ray(launch)
    stages = build_stages(files, directory, options)
    if launch.executor == "slurm":
        with slurm_submission(directory, launch.dry_run):
            previous = None
            for stage in stages:
                previous = executor_for(stage, directory / "logs" / stage.name, launch,
                                        previous)
                previous.run()
        return None
    for stage in stages:
        executor = executor_for(stage, directory / "logs" / stage.name, launch)
        executor.run()
        left = executor.get_incomplete_ranks()
        if left:
            logs = directory / "logs" / stage.name / "logs"
            raise RuntimeError(f"maxmoe data prepare: stage {stage.name}: tasks {left} failed "
                               f"or their process was killed (logs in {logs}); run the same "
                               "command again to rerun only those")
    return shards.load_manifest(str(directory))


def _settings_of(options: PrepareOptions) -> dict:
    settings = dataclasses.asdict(options)
    settings.pop("launch")  # where tasks run does not change the output
    settings["decontaminate"] = [os.path.abspath(p) for p in options.decontaminate]
    return json.loads(json.dumps(settings))


_OWNED = ("train-", "validation-", "shard-", "manifest", "settings", "logs", "work", "slurm",
          shards.TOKENIZER_DIR)


def _claim_directory(directory: Path, settings: dict, overwrite: bool) -> None:
    """Checks that `directory` is new, or holds a run with identical settings (to resume)."""
    path = directory / shards.SETTINGS
    if directory.exists() and overwrite:
        for entry in directory.iterdir():
            if entry.name.startswith(_OWNED):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous != settings:
            changed = sorted(k for k in settings if previous.get(k) != settings[k])
            raise ConfigError(f"option --out {str(directory)!r}: holds the shards of another "
                              f"prepare run (other {' and '.join(changed)}); use a new --out, "
                              "or --overwrite to start it again")
    elif directory.exists() and any(directory.iterdir()):
        raise ConfigError(f"option --out {str(directory)!r}: not empty and not a prepare run; "
                          "use a new or empty folder")
    directory.mkdir(parents=True, exist_ok=True)
    shards.write_json(path, settings)
