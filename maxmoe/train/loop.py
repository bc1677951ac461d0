"""The training loop: data -> jitted step -> metrics -> async checkpoints, with auto-resume.

Fault tolerance (README "Multi-host launch and fault tolerance"):
- resume: the newest checkpoint that reads back (corrupt ones are moved aside, see
  Checkpointer.resume); bit-exact on the same mesh and process layout;
- another process count, worker count or data config than the checkpoint's: params and
  optimizer state are resharded exactly, and the data restarts from the new layout's stream
  with its first `step` batches skipped on every process (not the same rows as before);
- SIGTERM: every process stops after the same step, saves it and returns with
  summary["preempted"] = True (the CLI then exits with code 75).

Host and device overlap (issue 8): the loop never waits for a step before it has dispatched
the next one. While the device runs step N+1 the host reads step N's metrics (guards,
logging) and the data thread's next batch is sharded; the host's guard decisions therefore
land one step late (guards.py). A step whose state is read on the host (saved, evaluated,
the last one, a SIGTERM stop) is settled before anything else happens, so no checkpoint
holds a state that a guard has not cleared. metrics.jsonl gets the host-side costs per
logging window (see metrics/host.py).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import jax
import numpy as np

from maxmoe.config import Config, fail, save_config, to_dict
from maxmoe.data.pipeline import make_dataset
from maxmoe.data.tokenizer import load_tokenizer
from maxmoe.metrics.flops import flops_per_token, peak_flops
from maxmoe.metrics.host import HostTiming
from maxmoe.metrics.writers import MetricsWriter
from maxmoe.model.spec import describe_pipeline
from maxmoe.sharding import global_batch, make_mesh, use_mesh
from maxmoe.train.checkpoint import EVAL_LOSS, Checkpointer
from maxmoe.train.guards import Action, Guard, TrainingStopped
from maxmoe.train.step import DIAGNOSTICS, make_trainer, writes_metrics
from maxmoe.validation import dcn_sizes


def log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, file=sys.stderr, flush=True)


class _Preemption:
    """Has any process been sent SIGTERM? Every process gets the same answer at each step.

    Several processes: jax.distributed's preemption service catches SIGTERM on whichever
    process gets it and makes `reached_preemption(step)` true on all of them at the same step
    (a Python handler here would shadow it). One process: a handler sets a flag.
    """

    def __init__(self, ckpt: Checkpointer):
        self._ckpt = ckpt
        self._signalled = False
        self._previous = None
        if jax.process_count() == 1:
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, *_):
        self._signalled = True

    def reached(self, step: int) -> bool:
        if jax.process_count() > 1:
            return self._ckpt.reached_preemption(step)
        return self._signalled

    def restore(self):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def data_layout(cfg: Config) -> dict:
    """What a saved iterator position depends on; resume restores it only if this matches."""
    return {"process_count": jax.process_count(), "data": to_dict(cfg)["data"]}


def make_evaluator(cfg: Config, trainer, tokenizer):
    """() -> mean validation loss over cfg.train.eval_batches batches (the same ones each time)."""
    from flax import nnx

    dataset = make_dataset(cfg.data, tokenizer, split="validation", num_epochs=1,
                           process_index=jax.process_index(), process_count=jax.process_count())

    @jax.jit
    def batch_loss(state, batch):
        buffers = (state["buffers"],) if "buffers" in state else ()
        # next-token cross-entropy only: the auxiliary MoE losses are not a language metric
        return nnx.merge(trainer.graphdef, state["params"], *buffers).loss(batch)[1]["ce_loss"]

    def evaluate(state) -> float:
        losses = []
        with use_mesh(trainer.mesh, trainer.rules):
            for i, local in enumerate(dataset):
                if i == cfg.train.eval_batches:
                    break
                losses.append(batch_loss(state, global_batch(local, trainer.batch_sharding)))
        return float(np.mean(jax.device_get(losses)))

    return evaluate


def train(cfg: Config, mesh_sizes: dict[str, int]) -> dict:
    """Trains to cfg.train.steps (resuming from the run directory); returns a summary."""
    run_dir = Path(cfg.run.dir).resolve()
    writer_process = jax.process_index() == 0
    if writer_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")

    tokenizer = load_tokenizer(cfg.data, cfg.model.vocab_size)
    if tokenizer.vocab_size != cfg.model.vocab_size:
        fail("model.vocab_size", cfg.model.vocab_size, None, f"the tokenizer at {tokenizer.path} "
             f"has {tokenizer.vocab_size} tokens",
             f"set model.vocab_size={tokenizer.vocab_size} or clear data.tokenizer_dir")
    dataset = make_dataset(cfg.data, tokenizer, process_index=jax.process_index(),
                           process_count=jax.process_count())
    mesh = make_mesh(mesh_sizes, dcn=dcn_sizes(cfg))
    trainer = make_trainer(cfg, mesh)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    layout, config_json = data_layout(cfg), to_dict(cfg)
    preemption = _Preemption(ckpt)  # from here on, SIGTERM means: save after the next step

    t = time.perf_counter()
    resumed = ckpt.resume(trainer.abstract_state, lambda: iter(dataset), layout, config_json)
    for bad in resumed.quarantined if resumed else []:
        log(f"warning: checkpoint step {bad.name} could not be restored (corrupt or "
            f"incomplete); moved it to {bad}")
    if resumed is not None:
        state, start, data_iter = resumed.state, resumed.step, resumed.data_iterator
        resume_s = time.perf_counter() - t
        log(f"resumed from {ckpt.directory / str(start)} in {resume_s:.1f}s")
        if not resumed.data_restored:
            # Grain's position is per process and worker: with another layout, continue the
            # new layout's stream after its first `start` batches (see the module docstring)
            t = time.perf_counter()
            for _ in range(start):
                next(data_iter)
            log(f"data: the checkpoint's iterator position is for another process count or "
                f"data config; skipped {start} batches of the new stream in "
                f"{time.perf_counter() - t:.1f}s instead")
    else:
        state, start, data_iter, resume_s = trainer.init(), 0, iter(dataset), None
    total = cfg.train.steps
    shape = " x ".join(f"{k}={v}" for k, v in mesh_sizes.items() if v > 1) or "1 device"
    log(f"mesh {shape}; run dir {run_dir}; steps {start} -> {total}")
    pipeline_line = describe_pipeline(cfg.model, mesh_sizes["pipeline"])
    if pipeline_line:
        log(pipeline_line)
    if start >= total:
        preemption.restore()
        ckpt.close()
        log("nothing to do: the run already reached train.steps (raise it to train further)")
        return {"start_step": start, "final_step": start, "preempted": False}

    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
    model_flops = flops_per_token(cfg) * tokens_per_step
    peak, peak_source = peak_flops(cfg)
    log(f"model FLOPs/step {model_flops:.3e}; peak {peak:.3e} FLOP/s ({peak_source})")
    writer = MetricsWriter(run_dir, total_steps=total, start_step=start, enabled=writer_process,
                           progress_bar=cfg.logging.progress_bar)
    evaluate = make_evaluator(cfg, trainer, tokenizer) if cfg.train.eval_every_steps else None
    guard = Guard(cfg.guard, log)
    timing = HostTiming()
    summary = {"start_step": start, "first_loss": None, "preempted": False, "resume_s": resume_s,
               "save_blocking_s": []}
    window = {"start": None, "steps": 0}
    t0 = time.perf_counter()

    def saved_at(done: int) -> bool:
        # the Checkpointer's FixedIntervalPolicy; the last and the preempted step are forced
        return cfg.checkpoint.enabled and done % cfg.checkpoint.every_steps == 0

    def settle(done: int, metrics: dict):
        """Guard decisions on step `done` -> (host metrics, None) or (None, (state, step)) after
        a rollback. Raises TrainingStopped before anything of the step is saved."""
        host = timing.fetch(metrics)
        decision = guard.observe(done, host)  # guards.py: skip / rollback / stop
        if decision.action is Action.STOP:
            raise TrainingStopped(decision.message)
        if decision.action is not Action.CONTINUE:
            log(decision.message)
        if decision.action is Action.ROLLBACK:
            restored = guard.rollback(done, ckpt, trainer.abstract_state, data_iter)
            if restored is not None:
                return None, restored
        return host, None

    def record(done: int, host: dict, last: bool, eval_metrics=None, eval_s: float = 0.0):
        """Counts step `done` into the logging window; writes the window when it ends."""
        if window["start"] is None:  # the first step compiles: time from its end on
            window["start"], window["steps"] = time.perf_counter(), 0
            summary["compile_and_first_step_s"] = window["start"] - t0
            summary["first_loss"] = float(host["loss"])
            timing.reset()
        else:
            window["steps"] += 1
        if not (writes_metrics(done, cfg) or last):
            return
        steps = window["steps"]
        elapsed = time.perf_counter() - window["start"] - eval_s
        tps = tokens_per_step * steps / elapsed if steps else 0.0
        window["start"], window["steps"] = time.perf_counter(), 0
        # a step cut short by SIGTERM has no DIAGNOSTICS (NaN): left out, not written as NaN
        rec = {k: v for k, v in host.items()
               if np.ndim(v) == 0 and not (k in DIAGNOSTICS and np.isnan(v))}
        rec.setdefault("activation_rms_max",  # all layers, from the step (guards)
                       float(np.max(host.get("activation_rms", 0.0))))
        rec.update(tokens_per_second=tps, mfu=tps / tokens_per_step * model_flops / peak,
                   step_time_s=tokens_per_step / tps if tps else None)
        rec.update(timing.window(steps, elapsed) if steps else {})
        rec.update(eval_metrics or {})
        writer.write(done, rec)
        summary.update(last_loss=float(host["loss"]), tokens_per_second=tps, mfu=rec["mfu"],
                       host_overhead_fraction=rec.get("host_overhead_fraction"))

    def next_batch():
        return global_batch(timing.next_batch(data_iter), trainer.batch_sharding)

    try:
        step, batch, pending = start, None, None
        while step < total:  # a guard rollback moves `step` back
            if batch is None:
                batch = next_batch()
            timing.dispatching()
            state, metrics = trainer.step(state, batch)
            timing.dispatched(metrics)
            done, batch = step + 1, None
            stop = preemption.reached(done)
            last = done == total or stop
            timing.probe()
            if pending is not None:
                # step done-1, one step late: the device runs step `done` meanwhile. A bad
                # update was already kept out of `state` by the step itself (its lax.cond).
                host, restored = settle(*pending)
                pending = None
                if restored is not None:  # step `done`, still running, is dropped
                    state, step = restored
                    continue
                record(done - 1, host, False)
            evaluating = evaluate is not None and done % cfg.train.eval_every_steps == 0
            if last or evaluating or saved_at(done) or window["start"] is None:
                # its state is read now: settle it first, so a bad state is never saved
                host, restored = settle(done, metrics)
                if restored is not None:
                    state, step = restored
                    continue
                eval_metrics, eval_s = None, 0.0
                if evaluating:
                    t = time.perf_counter()
                    eval_metrics = {EVAL_LOSS: evaluate(state)}
                    eval_s = time.perf_counter() - t  # not training time: kept out of tokens/s
                    timing.busy_now()
                    log(f"step {done}: eval loss {eval_metrics[EVAL_LOSS]:.4f}")
                record(done, host, last, eval_metrics, eval_s)
                t = time.perf_counter()
                # the iterator has handed out exactly `done` batches: the next one is fetched below
                if ckpt.save(done, state, data_iter, force=last, config=config_json,
                             meta=layout, metrics=eval_metrics):
                    summary["save_blocking_s"].append(round(time.perf_counter() - t, 3))
                if stop:
                    summary["preempted"] = done < total
                    log(f"SIGTERM: saved step {done}, exiting")
                    break
            else:
                pending = (done, metrics)
            step = done
            if step < total:
                batch = next_batch()  # sharded while step `done` runs
    finally:
        preemption.restore()
        writer.close()
        ckpt.close()
        data_iter.close()  # stops the prefetch thread
    summary["final_step"] = done
    return summary
