"""How a run reports: its stderr lines (process 0), its first logging window with the MFU peak,
and where each logged record goes (metrics.jsonl first, TensorBoard, W&B, the progress display)
through the logging hooks the loop runs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import jax

from maxmoe.config import Config
from maxmoe.metrics.flops import mfu_peak
from maxmoe.metrics.host import HostTiming
from maxmoe.metrics.progress import Progress, progress_metrics, say
from maxmoe.metrics.tensorboard import TensorBoardWriter
from maxmoe.metrics.wandb_writer import WandbWriter
from maxmoe.metrics.writers import Background, MetricsWriter, Sink
from maxmoe.train.hooks import Hook, LogWindow, StepEnd
from maxmoe.train.setup import RunSetup


def log(msg: str) -> None:
    if jax.process_index() == 0:
        say(msg)


def side_work(what: str, timeout_s: float, work: Callable[[], float]) -> float | None:
    """Runs process-0 work that the job does not need (plan.json) so that it cannot stall or
    kill the job: in a daemon thread, waited for up to timeout_s (the other processes wait at
    a barrier meanwhile). Returns what `work` returned; None, after one warning line, when it
    raised or ran past timeout_s (it then finishes, or not, in the background)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = work()
        except Exception as e:  # noqa: BLE001 - any failure of side work is only a warning
            out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    thread = threading.Thread(target=run, name=f"maxmoe {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if "value" in out:
        return out["value"]
    why = out.get("error") or f"took over logging.side_work_timeout_s={timeout_s:g} s"
    log(f"warning: {what} not written ({why}); training goes on without it")
    return None


def log_window(setup: RunSetup) -> LogWindow:
    """The run's first LogWindow, its MFU (metrics.jsonl, the progress bar) against
    metrics.flops.mfu_peak: FP8-class FLOPs over the FP8 peak and the rest over the bf16 one
    under precision.fp8, as `maxmoe bench` counts; logs the FLOPs and the peak."""
    peak = mfu_peak(setup.cfg)
    if peak is None:  # an accelerator with no configs/devices/ file: mfu_peak warned once
        log(f"model FLOPs/step {setup.model_flops:.3e}; no peak, MFU left out")
        return LogWindow(setup, None, HostTiming())
    log(f"model FLOPs/step {setup.model_flops:.3e}; peak {peak[0]:.3e} FLOP/s ({peak[1]})")
    return LogWindow(setup, peak[0], HostTiming())


def metric_sinks(cfg: Config, run_dir: Path, start: int) -> list[Sink]:
    """Where process 0 writes each logged record: metrics.jsonl (the source of truth, first),
    TensorBoard and W&B (each in its own thread, writers.Background), the progress display."""
    sinks: list[Sink] = [MetricsWriter(run_dir, enabled=True)]
    if cfg.logging.tensorboard:
        sinks.append(Background(TensorBoardWriter(run_dir / "tensorboard", start), "tensorboard"))
    if cfg.logging.wandb_project:
        sinks.append(Background(WandbWriter(cfg, run_dir), "W&B"))
    return [*sinks, Progress(cfg.train.steps, cfg.logging.progress_bar)]


def logging_hooks(every: int, tokens_per_step: int, sinks: list[Sink]) -> list[Hook]:
    """The logging hooks, at the same steps on every process: first the progress figures of
    the record (a collective with several processes, so every process runs it), then one hook
    per sink (process 0 has them; the other processes none)."""
    def add_progress(event: StepEnd) -> None:
        record = event.record()
        record.update(progress_metrics(event.step, tokens_per_step, record.get("step_time_s")))

    return [Hook(every, fn, at_end=True, writes=True) for fn in [
        add_progress, *[lambda e, s=s: s.write(e.step, e.record()) for s in sinks]]]
