"""Progress: the figures every logged record gets (`progress_metrics`: tokens seen, peak device
memory, each process's step time) and what a person watches (`Progress`: a tqdm bar, or with
logging.progress_bar=false one plain line per logged step with an ETA)."""

from __future__ import annotations

import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm


def peak_memory_bytes() -> int | None:
    """The most device memory any of this process's devices has held since the process began
    (`peak_bytes_in_use` of memory_stats()); None where the backend keeps no statistics (CPU)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    peaks = [p for p in peaks if p is not None]
    return int(max(peaks)) if peaks else None


def step_times_by_process(step_time_s: float | None) -> list[float | None]:
    """[P]: every process's step time over its last logging window, for spotting stragglers.
    A collective: every process must call it at the same steps (the loop's logging hooks). It
    runs on the devices behind the step in flight, so on a logged step the host waits for that
    step; the device then idles for the rest of the host's logging work (one hand-off per
    logged step, only with several processes)."""
    mine = np.float32(np.nan if step_time_s is None else step_time_s)
    times = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)
    return [float(t) if np.isfinite(t) else None for t in times]


def progress_metrics(step: int, tokens_per_step: int, step_time_s: float | None) -> dict:
    """What a logged record gets on every process: tokens_seen (steps done x tokens per step,
    padding included), peak_memory_bytes (GPU only) and step_time_s_by_process (several
    processes only; a collective, see step_times_by_process)."""
    out: dict = {"tokens_seen": step * tokens_per_step}
    peak = peak_memory_bytes()
    if peak is not None:
        out["peak_memory_bytes"] = peak
    if jax.process_count() > 1:
        out["step_time_s_by_process"] = step_times_by_process(step_time_s)
    return out


def si(n: float) -> str:
    """1234567 -> '1.23M' (k, M, B, T)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def duration(seconds: float) -> str:
    """3725 -> '1h02m', 125 -> '2m05s', 7 -> '7s'."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def say(msg: str) -> None:
    """One line to stderr, printed above a progress bar that is showing (not glued to it)."""
    tqdm.write(msg, file=sys.stderr)
    sys.stderr.flush()


def _number(v) -> float:
    return float("nan") if v is None else v  # a skipped step's loss may be non-finite (None)


class Progress:
    """Shows each logged record: a tqdm bar (steps, with loss, tokens/s, MFU, host share and
    tokens seen), or one stderr line with an ETA. Both start at the first logged step, which is
    the run's first (compiled) step, so compile time is not in the rate or the ETA; evaluation
    and checkpoint time are (they recur until the end). Without a terminal on stderr, lines
replace the bar. Process 0 only."""

    def __init__(self, total_steps: int, bar: bool):
        # a bar needs a terminal: redirected to a file, its cursor codes would fill the log
        self.total, self.use_bar = total_steps, bar and sys.stderr.isatty()
        self.bar = None
        self.first: tuple[int, float] | None = None  # (step, perf_counter) of the first record
        self.last_step = 0

    def eta_s(self, step: int) -> float | None:
        """Seconds to train.steps at the mean pace since the first record; None before that."""
        if self.first is None or step <= self.first[0]:
            return None
        pace = (time.perf_counter() - self.first[1]) / (step - self.first[0])
        return pace * (self.total - step)

    def write(self, step: int, record: dict) -> None:
        if self.first is None:
            self.first, self.last_step = (step, time.perf_counter()), step
            if self.use_bar:
                self.bar = tqdm(total=self.total, initial=step, desc="train", unit="step",
                                dynamic_ncols=True, file=sys.stderr)
        host, mfu = record.get("host_overhead_fraction"), record.get("mfu")
        tokens = record.get("tokens_seen")
        if self.bar is not None:
            self.bar.update(step - self.last_step)
            self.bar.set_postfix(loss=f"{_number(record['loss']):.3f}",
                                 tok_s=f"{record['tokens_per_second']:.0f}",
                                 **({"mfu": f"{100 * mfu:.1f}%"} if mfu is not None else {}),
                                 **({"host": f"{100 * host:.1f}%"} if host is not None else {}),
                                 **({"tokens": si(tokens)} if tokens is not None else {}))
        else:
            eta = self.eta_s(step)
            print(f"step {step}: loss {_number(record['loss']):.4f} tokens/s "
                  f"{record['tokens_per_second']:.0f}"
                  + (f" mfu {100 * mfu:.1f}%" if mfu is not None else "")
                  + (f" host {100 * host:.1f}%" if host is not None else "")
                  + (f" tokens {si(tokens)}" if tokens is not None else "")
                  + (f" eta {duration(eta)}" if eta is not None else ""), file=sys.stderr)
        self.last_step = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
