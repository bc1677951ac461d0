"""Weights & Biases logging (optional: `pip install 'maxmoe[wandb]'`, on when
logging.wandb_project is set). The same tags as TensorBoard (metrics/tensorboard.py); the
run's files go to <run.dir>/wandb. In offline mode (the default) nothing touches the network:
`wandb sync <run.dir>/wandb/offline-run-*` uploads later."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from maxmoe.config import Config, LoggingConfig, fail
from maxmoe.config_files import to_dict
from maxmoe.metrics.tensorboard import Heatmap, flatten

MODES = ("offline", "online", "disabled")


def check_wandb(lg: LoggingConfig) -> None:
    """Raises a one-line ConfigError when W&B is asked for but cannot run (an unknown mode, the
    package missing); called before the run starts, on every process."""
    if not lg.wandb_project:
        return
    if lg.wandb_mode not in MODES:
        fail("logging.wandb_mode", lg.wandb_mode, None, "unknown mode", f"use one of {MODES}")
    if importlib.util.find_spec("wandb") is None:
        fail("logging.wandb_project", lg.wandb_project, None, "the wandb package is not "
             "installed", "pip install 'maxmoe[wandb]', or set logging.wandb_project=''")


RUN_ID_FILE = "wandb_run_id"  # in run.dir: the W&B run every restart of the job resumes


class WandbWriter:
    """One W&B run in <run_dir>/wandb, logged against the training step (the metric "step",
    so that steps repeated after a guard rollback are kept, not dropped as out of order).
    Its id is kept in <run_dir>/wandb_run_id, so a job restarted (preemption, crash) logs
    into the same W&B run."""

    def __init__(self, cfg: Config, run_dir: Path):
        # imported here, not at the top: an optional extra (check_wandb names it) that takes
        # seconds to import, which a run without W&B should not pay
        import wandb

        self.wandb = wandb
        id_file = run_dir / RUN_ID_FILE
        if not id_file.is_file():
            id_file.write_text(wandb.util.generate_id() + "\n")
        self.run = wandb.init(project=cfg.logging.wandb_project, mode=cfg.logging.wandb_mode,
                              dir=str(run_dir), name=cfg.run.name or run_dir.name,
                              config=to_dict(cfg), id=id_file.read_text().strip(),
                              resume="allow",
                              # console off: W&B would otherwise wrap sys.stdout/stderr, under
                              # the progress bar and every other thread's output
                              settings=wandb.Settings(silent=True, console="off"))
        self.heatmap = Heatmap()
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, step: int, record: dict) -> None:
        flat = flatten(record)
        data: dict = {"step": step, **flat.scalars}
        data.update({t: self.wandb.Histogram(v) for t, v in flat.histograms.items()})
        data.update({f"{k}/heatmap": self.wandb.Image(self.heatmap(v))
                     for k, v in flat.heatmaps.items()})
        self.run.log(data)

    def close(self) -> None:
        self.run.finish()
