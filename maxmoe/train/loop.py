"""The training loop: data -> jitted step -> metrics -> async checkpoints, with auto-resume."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from maxmoe.config import Config, ConfigError, save_config
from maxmoe.data.pipeline import make_dataset
from maxmoe.data.tokenizer import load_tokenizer
from maxmoe.metrics.flops import flops_per_token, peak_flops
from maxmoe.metrics.writers import MetricsWriter
from maxmoe.sharding import make_mesh
from maxmoe.train.checkpoint import Checkpointer
from maxmoe.train.step import make_trainer


def global_batch(local: dict[str, np.ndarray], sharding) -> dict[str, jax.Array]:
    """This process's rows -> one global jax.Array per key, sharded over the batch axes."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


def log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, file=sys.stderr, flush=True)


class _Preemption:
    """SIGTERM sets a flag; the loop saves the current step and exits cleanly."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, *_):
        self.requested = True

    def restore(self):
        signal.signal(signal.SIGTERM, self._previous)


def train(cfg: Config, mesh_sizes: dict[str, int]) -> dict:
    """Trains to cfg.train.steps (resuming from the run directory); returns a summary."""
    run_dir = Path(cfg.run.dir).resolve()
    writer_process = jax.process_index() == 0
    if writer_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")

    tokenizer = load_tokenizer(cfg.data, cfg.model.vocab_size)
    if tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"config key 'model.vocab_size' = {cfg.model.vocab_size}: the tokenizer "
                          f"at {tokenizer.path} has {tokenizer.vocab_size} tokens; set "
                          f"model.vocab_size={tokenizer.vocab_size} or clear data.tokenizer_dir")
    data_iter = iter(make_dataset(cfg.data, tokenizer, process_index=jax.process_index(),
                                  process_count=jax.process_count()))
    mesh = make_mesh(mesh_sizes)
    trainer = make_trainer(cfg, mesh)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)

    if ckpt.latest_step() is not None:
        t = time.perf_counter()
        state, start = ckpt.restore(trainer.abstract_state, data_iter)
        log(f"resumed from {ckpt.directory / str(start)} in {time.perf_counter() - t:.1f}s")
    else:
        state, start = trainer.init(), 0
    total = cfg.train.steps
    shape = " x ".join(f"{k}={v}" for k, v in mesh_sizes.items() if v > 1) or "1 device"
    log(f"mesh {shape}; run dir {run_dir}; steps {start} -> {total}")
    if start >= total:
        ckpt.close()
        log("nothing to do: the run already reached train.steps (raise it to train further)")
        return {"start_step": start, "final_step": start}

    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    model_flops = flops_per_token(cfg) * tokens_per_step
    peak, peak_source = peak_flops(cfg)
    log(f"model FLOPs/step {model_flops:.3e}; peak {peak:.3e} FLOP/s ({peak_source})")
    writer = MetricsWriter(run_dir, total_steps=total, start_step=start, enabled=writer_process,
                           progress_bar=cfg.logging.progress_bar)
    preemption = _Preemption()
    summary = {"start_step": start, "first_loss": None}
    window_start, window_steps = None, 0
    t0 = time.perf_counter()
    try:
        for step in range(start, total):
            batch = global_batch(next(data_iter), trainer.batch_sharding)
            state, metrics = trainer.step(state, batch)
            done = step + 1
            if window_start is None:  # the first step compiles: time from its end on
                jax.block_until_ready(metrics)
                window_start, window_steps = time.perf_counter(), 0
                summary["compile_and_first_step_s"] = window_start - t0
                summary["first_loss"] = float(metrics["loss"])
            else:
                window_steps += 1
            last = done == total or preemption.requested
            if done % cfg.logging.every_steps == 0 or last:
                metrics = jax.device_get(metrics)
                elapsed = time.perf_counter() - window_start
                tps = tokens_per_step * window_steps / elapsed if window_steps else 0.0
                window_start, window_steps = time.perf_counter(), 0
                record = {k: v for k, v in metrics.items() if np.ndim(v) == 0}
                record["activation_rms_max"] = float(np.max(metrics.get("activation_rms", 0.0)))
                record.update(tokens_per_second=tps, mfu=tps / tokens_per_step * model_flops / peak,
                              step_time_s=tokens_per_step / tps if tps else None)
                writer.write(done, record)
                summary.update(last_loss=float(metrics["loss"]), tokens_per_second=tps,
                               mfu=record["mfu"])
            ckpt.save(done, state, data_iter, force=last)
            if preemption.requested:
                log(f"SIGTERM: saved step {done}, exiting")
                break
    finally:
        preemption.restore()
        writer.close()
        ckpt.close()
    summary["final_step"] = done
    return summary
