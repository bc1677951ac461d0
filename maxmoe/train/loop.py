"""The training loop: data -> jitted step -> metrics -> async checkpoints, with auto-resume.

Fault tolerance (README "Multi-host launch and fault tolerance"):
- resume: the newest checkpoint that reads back (corrupt ones are moved aside, see
  Checkpointer.resume); bit-exact on the same mesh and process layout;
- another process count, worker count or data config than the checkpoint's: params and
  optimizer state are resharded exactly, and the data restarts from the new layout's stream
  with its first `step` batches skipped on every process (not the same rows as before);
- SIGTERM: every process stops after the same step, saves it and returns with
  summary["preempted"] = True (the CLI then exits with code 75).

Host and device overlap: the loop never waits for a step before it has dispatched
the next one. While the device runs step N+1 the host reads step N's metrics (guards,
logging) and the data thread's next batch is sharded; the host's guard decisions therefore
land one step late (guards.py). A step whose state is read on the host (saved, evaluated,
the last one, a SIGTERM stop) is settled before anything else happens, so no checkpoint
holds a state that a guard has not cleared. metrics.jsonl gets the host-side costs per
logging window (see metrics/host.py).

Cadences are hooks, run in order after a step: eval (train.eval_every_steps), the metrics
writer (logging.every_steps, the last step and every eval step) and the checkpoint save
(checkpoint.every_steps and the last step). See `train/hooks.py`.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from maxmoe.config import Config, fail, save_config, to_dict
from maxmoe.data.pipeline import make_dataset
from maxmoe.data.tokenizer import load_tokenizer
from maxmoe.distributed import wait_for_processes
from maxmoe.metrics.flops import peak_flops
from maxmoe.metrics.host import HostTiming
from maxmoe.metrics.router_health import moe_layer_indices
from maxmoe.metrics.writers import MetricsWriter
from maxmoe.plan.live import live_cluster, write_plan
from maxmoe.sharding import global_batch, use_mesh
from maxmoe.train.checkpoint import EVAL_LOSS, Checkpointer
from maxmoe.train.guards import Action, Guard, TrainingStopped
from maxmoe.train.hooks import Hook, LogWindow, StepEnd
from maxmoe.train.setup import RunSetup, prepare_run


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


def _open_run_dir(cfg: Config) -> Path:
    """The run directory, created with the resolved config in it (by process 0)."""
    run_dir = Path(cfg.run.dir).resolve()
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    return run_dir


def _load_tokenizer(cfg: Config):
    """The data's tokenizer; a vocabulary of another size than the model's is a config error."""
    tokenizer = load_tokenizer(cfg.data, cfg.model.vocab_size)
    if tokenizer.vocab_size != cfg.model.vocab_size:
        fail("model.vocab_size", cfg.model.vocab_size, None, f"the tokenizer at {tokenizer.path} "
             f"has {tokenizer.vocab_size} tokens",
             f"set model.vocab_size={tokenizer.vocab_size} or clear data.tokenizer_dir")
    return tokenizer


def _resume(ckpt: Checkpointer, trainer, dataset, layout: dict, config_json: dict):
    """(state, start step, data iterator, seconds the restore took or None): the newest
    checkpoint that reads back, else a fresh state at step 0."""
    t = time.perf_counter()
    resumed = ckpt.resume(trainer.abstract_state, lambda: iter(dataset), layout, config_json)
    for bad in resumed.quarantined if resumed else []:
        log(f"warning: checkpoint step {bad.name} could not be restored (corrupt or "
            f"incomplete); moved it to {bad}")
    if resumed is None:
        return trainer.init(), 0, iter(dataset), None
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
    return state, start, data_iter, resume_s


def train(cfg: Config, mesh_sizes: dict[str, int], cluster: str = "") -> dict:
    """Trains to cfg.train.steps (resuming from the run directory); returns a summary.
    cluster: the --cluster spec that prices <run.dir>/plan.json (default: the devices' kind)."""
    plan_cluster = live_cluster(cluster)  # a bad spec fails before the run dir is made
    run_dir = _open_run_dir(cfg)
    tokenizer = _load_tokenizer(cfg)
    dataset = make_dataset(cfg.data, tokenizer, process_index=jax.process_index(),
                           process_count=jax.process_count())
    setup = prepare_run(cfg, mesh_sizes)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint)
    layout, config_json = data_layout(cfg), to_dict(cfg)
    preemption = _Preemption(ckpt)  # from here on, SIGTERM means: save after the next step
    state, start, data_iter, resume_s = _resume(ckpt, setup.trainer, dataset, layout, config_json)
    total = cfg.train.steps
    shape = " x ".join(f"{k}={v}" for k, v in setup.mesh_shape.items()) or "1 device"
    log(f"mesh {shape}; run dir {run_dir}; steps {start} -> {total}")
    for line in (setup.pipeline_line, setup.transport_line):
        if line:
            log(line)
    if start >= total:
        preemption.restore()
        ckpt.close()
        log("nothing to do: the run already reached train.steps (raise it to train further)")
        return {"start_step": start, "final_step": start, "preempted": False}
    peak, peak_source = peak_flops(cfg)
    log(f"model FLOPs/step {setup.model_flops:.3e}; peak {peak:.3e} FLOP/s ({peak_source})")
    writer = MetricsWriter(run_dir, total_steps=total, start_step=start,
                           enabled=jax.process_index() == 0, progress_bar=cfg.logging.progress_bar)
    loop = _Loop(setup, ckpt, data_iter, preemption, LogWindow(setup, peak, HostTiming()))
    if jax.process_index() == 0:
        loop.plan = (run_dir / "plan.json", plan_cluster)
    loop.hooks += [
        *([Hook(cfg.train.eval_every_steps, loop.evaluator(tokenizer), reads_state=True)]
          if cfg.train.eval_every_steps else []),
        Hook(cfg.logging.every_steps, lambda e: writer.write(e.step, e.record()), at_end=True,
             writes=True),
        Hook(cfg.checkpoint.every_steps if cfg.checkpoint.enabled else 0,
             loop.saver(config_json, layout), at_end=True, reads_state=True),
    ]
    summary = {"start_step": start, "first_loss": None, "preempted": False, "resume_s": resume_s,
               "save_blocking_s": loop.save_blocking_s, "plan_json_s": None}
    try:
        final_step = loop.run(state, start, summary)
    finally:
        preemption.restore()
        writer.close()
        ckpt.close()
        data_iter.close()  # stops the prefetch thread
    rec = loop.window.last  # the newest logged step's figures
    if rec is not None:
        summary.update(last_loss=float(rec["loss"]), tokens_per_second=rec["tokens_per_second"],
                       mfu=rec["mfu"], host_overhead_fraction=rec.get("host_overhead_fraction"))
    summary["final_step"] = final_step
    return summary


class _Loop:
    """The steps of one run: dispatch, guards one step late, hooks (module docstring)."""

    def __init__(self, setup: RunSetup, ckpt: Checkpointer, data_iter, preemption: _Preemption,
                 window: LogWindow):
        self.setup, self.trainer, self.ckpt = setup, setup.trainer, ckpt
        self.data_iter, self.preemption, self.window = data_iter, preemption, window
        self.timing = window.timing
        self.guard = Guard(setup.cfg.guard, log, moe_layers=moe_layer_indices(setup.cfg.model))
        self.hooks: list[Hook] = []
        self.save_blocking_s: list[float] = []
        self.t0 = 0.0  # when the loop started: the first step's compile time counts from it
        self.plan = None  # (path, cluster or None): where process 0 writes the plan's figures

    def evaluator(self, tokenizer) -> Callable[[StepEnd], None]:
        """The eval hook: the validation loss of the step's state into `event.extra`."""
        evaluate = make_evaluator(self.setup.cfg, self.trainer, tokenizer)

        def run_eval(event: StepEnd) -> None:
            t = time.perf_counter()
            event.extra[EVAL_LOSS] = evaluate(event.state)
            self.window.excluded_s += time.perf_counter() - t  # not training time
            self.timing.busy_now()
            log(f"step {event.step}: eval loss {event.extra[EVAL_LOSS]:.4f}")
        return run_eval

    def saver(self, config_json: dict, layout: dict) -> Callable[[StepEnd], None]:
        """The save hook: an async checkpoint (forced at the last step), with the eval loss
        that ranks it for checkpoint.keep_best."""
        def save(event: StepEnd) -> None:
            t = time.perf_counter()
            # the iterator has handed out exactly `step` batches: the next one is fetched after
            if self.ckpt.save(event.step, event.state, self.data_iter, force=event.last,
                              config=config_json, meta=layout, metrics=event.extra or None):
                self.save_blocking_s.append(round(time.perf_counter() - t, 3))
        return save

    def settle(self, done: int, metrics: dict):
        """Guard decisions on step `done` -> (host metrics, None) or (None, (state, step)) after
        a rollback. Raises TrainingStopped before anything of the step is saved."""
        host = self.timing.fetch(metrics)
        decision = self.guard.observe(done, host)  # guards.py: skip / rollback / stop
        if decision.action is Action.STOP:
            raise TrainingStopped(decision.message)
        if decision.action is not Action.CONTINUE:
            log(decision.message)
        if decision.action is Action.ROLLBACK:
            restored = self.guard.rollback(done, self.ckpt, self.trainer.abstract_state,
                                           self.data_iter)
            if restored is not None:
                return None, restored
        return host, None

    def finish(self, event: StepEnd, summary: dict) -> None:
        """Counts a settled step into the logging window, then runs the hooks due at it
        (state hooks only when `event.state` is there)."""
        if self.window.count():  # the first step compiles: time from its end on
            summary["compile_and_first_step_s"] = self.window.started - self.t0
            summary["first_loss"] = float(event.host["loss"])
        for hook in self.hooks:
            if (event.state is not None or not hook.reads_state) and hook.due(
                    event.step, event.last, bool(event.extra)):
                hook.fn(event)

    def reads_state(self, done: int) -> bool:
        """Whether step `done` is settled at once: a hook reads its state, or it is the first."""
        return self.window.started is None or any(
            h.reads_state and h.due(done, False) for h in self.hooks)

    def compile_first(self, state, batch, summary: dict) -> None:
        """Compiles the step ahead of its first call (the jit call then finds the executable in
        JAX's cache: no second compile), writes plan.json from it (process 0), and with several
        processes waits until every one has compiled: their first collective must meet within
        Gloo's fixed 30 s on CPU, less than the compile-time skew of a loaded host."""
        t = time.perf_counter()
        with use_mesh(self.trainer.mesh, self.trainer.rules):
            compiled = self.trainer.jitted_step.lower(state, batch).compile()
        if self.plan is not None:
            path, cluster = self.plan
            summary["plan_json_s"] = round(
                write_plan(path, self.setup, compiled, cluster, time.perf_counter() - t), 3)
        if jax.process_count() > 1:
            wait_for_processes("maxmoe_first_step_compiled",
                               self.setup.cfg.distributed.initialization_timeout_s)

    def next_batch(self):
        return global_batch(self.timing.next_batch(self.data_iter), self.trainer.batch_sharding)

    def run(self, state, start: int, summary: dict) -> int:
        """Steps from `start` to train.steps (or a SIGTERM); returns the last step done.

        One step late: step N is dispatched before step N-1's metrics are read, so the device
        runs step N while the host settles N-1 (guards, logging). A step whose state a hook
        reads, the first and the last are settled before anything else happens."""
        total, trainer, timing = self.setup.cfg.train.steps, self.trainer, self.timing
        self.t0 = time.perf_counter()
        step, batch, pending = start, self.next_batch(), None
        self.compile_first(state, batch, summary)
        while step < total:  # a guard rollback moves `step` back
            if batch is None:
                batch = self.next_batch()
            timing.dispatching()
            state, metrics = trainer.step(state, batch)
            timing.dispatched(metrics)
            done, batch = step + 1, None
            stop = self.preemption.reached(done)
            last = done == total or stop
            timing.probe()
            if pending is not None:
                # step done-1, one step late: the device runs step `done` meanwhile. A bad
                # update was already kept out of `state` by the step itself (its lax.cond).
                host, restored = self.settle(*pending)
                pending = None
                if restored is not None:  # step `done`, still running, is dropped
                    state, step = restored
                    continue
                self.finish(StepEnd(done - 1, False, host, self.window), summary)
            if last or self.reads_state(done):
                # its state is read now: settle it first, so a bad state is never saved
                host, restored = self.settle(done, metrics)
                if restored is not None:
                    state, step = restored
                    continue
                self.finish(StepEnd(done, last, host, self.window, state), summary)
                if stop:
                    summary["preempted"] = done < total
                    log(f"SIGTERM: saved step {done}, exiting")
                    break
            else:
                pending = (done, metrics)
            step = done
            if step < total:
                batch = self.next_batch()  # sharded while step `done` runs
        return done
