"""Where metrics go: metrics.jsonl (one object per logged step) and a tqdm progress bar."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm import tqdm


def _plain(v):
    v = float(v) if hasattr(v, "__float__") else v
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _number(v) -> float:
    return float("nan") if v is None else v  # a skipped step's loss may be non-finite (None)


class MetricsWriter:
    """Only process 0 writes; other processes get a writer that does nothing."""

    def __init__(self, run_dir: Path, *, total_steps: int, start_step: int, enabled: bool,
                 progress_bar: bool):
        self.enabled = enabled
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.bar = (tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                         dynamic_ncols=True, file=sys.stderr)
                    if enabled and progress_bar else None)
        self.last_step = start_step

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        # share of the window's wall time the device had no step to run (metrics/host.py HostTiming)
        host = record.get("host_overhead_fraction")
        if self.bar is not None:
            self.bar.update(step - self.last_step)
            self.bar.set_postfix(loss=f"{_number(record['loss']):.3f}",
                                 tok_s=f"{record['tokens_per_second']:.0f}",
                                 mfu=f"{100 * record['mfu']:.1f}%",
                                 **({"host": f"{100 * host:.1f}%"} if host is not None else {}))
        else:
            print(f"step {step}: loss {_number(record['loss']):.4f} tokens/s "
                  f"{record['tokens_per_second']:.0f} mfu {100 * record['mfu']:.1f}%"
                  + (f" host {100 * host:.1f}%" if host is not None else ""), file=sys.stderr)
        self.last_step = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
