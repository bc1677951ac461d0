"""FP8 training quality against BF16: the same config, seeds and data trained with
precision.fp8 = none (bfloat16 compute), tensorwise and blockwise; prints a markdown table.

python3 tools/fp8_quality.py OUT_DIR [CONFIG.yaml ...] [KEY=VALUE ...]

Defaults to configs/tiny.yaml (200 steps, eval every 50). Per mode: the final 20-step mean
training loss, the last eval loss, their relative gaps to BF16, the maximum relative gap of
the per-step loss curve and of its 10-step running mean, and the median step time (the CPU
cost of FP8 emulation: XLA:CPU upcasts E4M3 dots). Each run's metrics.jsonl stays in
OUT_DIR/<mode>/.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

MODES = ("none", "tensorwise", "blockwise")


def train(out: Path, mode: str, configs: list[str], overrides: list[str]) -> list[dict]:
    """Runs `maxmoe train` for one mode (logging every step) and returns its metric records."""
    run_dir = out / mode
    if not (run_dir / "metrics.jsonl").exists():
        cmd = [sys.executable, "-m", "maxmoe.cli", "train", *configs,
               "precision.compute_dtype=bfloat16", f"precision.fp8={mode}",
               f"run.dir={run_dir.resolve()}", "logging.every_steps=1",
               "logging.progress_bar=false", *overrides]
        subprocess.run(cmd, check=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarise(records: list[dict]) -> dict:
    """{steps, loss [N] by step, eval_loss (last), step_time_s (median)} of one run."""
    train_recs = sorted((r for r in records if "loss" in r), key=lambda r: r["step"])
    evals = [r["eval_loss"] for r in sorted(records, key=lambda r: r["step"]) if "eval_loss" in r]
    times = [r["step_time_s"] for r in train_recs[len(train_recs) // 4:] if "step_time_s" in r]
    return {"steps": [r["step"] for r in train_recs],
            "loss": np.array([r["loss"] for r in train_recs], np.float64),
            "eval_loss": evals[-1] if evals else float("nan"),
            "step_time_s": statistics.median(times) if times else float("nan")}


def running_mean(x: np.ndarray, n: int) -> np.ndarray:
    return np.convolve(x, np.ones(n) / n, mode="valid")


def table(runs: dict[str, dict]) -> str:
    """The markdown table of every mode against `none`."""
    ref = runs["none"]
    lines = ["| mode | final 20-step mean loss | gap | eval loss | gap | max curve gap "
             "(per step / 10-step mean) | step time s (x BF16) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for mode, r in runs.items():
        n = min(len(r["loss"]), len(ref["loss"]))
        final, final_ref = r["loss"][n - 20:n].mean(), ref["loss"][n - 20:n].mean()
        gap = np.abs(r["loss"][:n] - ref["loss"][:n]) / ref["loss"][:n]
        smooth = running_mean(r["loss"][:n], 10)
        smooth_ref = running_mean(ref["loss"][:n], 10)
        sgap = np.abs(smooth - smooth_ref) / smooth_ref
        lines.append(
            f"| {mode} | {final:.4f} | {abs(final - final_ref) / final_ref:.2%} | "
            f"{r['eval_loss']:.4f} | {abs(r['eval_loss'] - ref['eval_loss']) / ref['eval_loss']:.2%}"
            f" | {gap.max():.2%} / {sgap.max():.2%} | {r['step_time_s']:.3f} "
            f"({r['step_time_s'] / ref['step_time_s']:.2f}) |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    configs = [a for a in argv[1:] if a.endswith((".yaml", ".yml"))] or ["configs/tiny.yaml"]
    overrides = [a for a in argv[1:] if "=" in a and not a.endswith((".yaml", ".yml"))]
    runs = {mode: summarise(train(out, mode, configs, overrides)) for mode in MODES}
    print(table(runs))


if __name__ == "__main__":
    main(sys.argv[1:])
