"""The training loop: data -> jitted step -> metrics -> async checkpoints, with auto-resume.

Fault tolerance (docs/multi-host-and-faults.md):
- resume: the newest checkpoint that reads back (corrupt ones are moved aside, see
  Checkpointer.resume); bit-exact on the same mesh and process layout;
- another process count, worker count or data config than the checkpoint's: params and
  optimizer state are resharded exactly, and the data restarts from the new layout's stream
  with its first `step` batches skipped on every process (not the same rows as before);
- SIGTERM: every process stops after the same step, saves it and returns with
  summary["preempted"] = True (the CLI then exits with code 75);
- a run without checkpoints of its own starts from train.init_from's weights where it is set
  (train/init_from.py); once it has some, resume wins.

Host and device overlap: the loop never waits for a step before it has dispatched
the next one. While the device runs step N+1 the host reads step N's metrics (guards,
logging) and the data thread's next batch is sharded; the host's guard decisions therefore
land one step late (guards.py). A step whose state is read on the host (saved, evaluated,
the last one, a SIGTERM stop) is settled before anything else happens, so no checkpoint
holds a state that a guard has not cleared. metrics.jsonl gets the host-side costs per
logging window (see metrics/host.py).

Cadences are hooks, run in order after a step: eval (train.eval_every_steps), the progress
figures of the record (every process), the metrics writers (process 0: metrics.jsonl,
TensorBoard, W&B, the progress bar or lines), all at logging.every_steps, the last step and
every eval step, and the checkpoint save (checkpoint.every_steps and the last step). See
`train/hooks.py`. Guard decisions also go to <run.dir>/events.jsonl (metrics/events.py). The
profiling window (logging.profile_start, `train/profiling.py`) is no after-step hook: it wraps
the dispatch of its first and last steps, waiting for whole steps at its edges. The eval hook
runs `train/evaluate.py`'s Evaluator, which `maxmoe eval` runs on a saved checkpoint.

The run's tokenizer (with its chat template) is saved in <run.dir>/tokenizer/ at start, where
`maxmoe generate` and `maxmoe eval` open it (data/tokenizer.py, open_tokenizer).
"""

from __future__ import annotations

import functools
import signal
import time
from collections.abc import Callable
from pathlib import Path

import jax

from maxmoe.config import Config
from maxmoe.config_files import save_config, to_dict
from maxmoe.data.pipeline import make_dataset
from maxmoe.data.tokenizer import RUN_TOKENIZER_DIR, save_tokenizer
from maxmoe.distributed import wait_for_processes
from maxmoe.metrics.events import EventLog
from maxmoe.metrics.wandb_writer import check_wandb
from maxmoe.model.spec import moe_layer_indices
from maxmoe.sharding import global_batch, use_mesh
from maxmoe.train.checkpoint import EVAL_LOSS, Checkpointer
from maxmoe.train.evaluate import Evaluator, model_tokenizer
from maxmoe.train.goodput import Goodput, goodput_summary
from maxmoe.train.guards import Action, Guard, TrainingStopped
from maxmoe.train.hooks import Hook, LogWindow, StepEnd
from maxmoe.train.init_from import InitSource, initial_state, needs_init_from, open_init_source
from maxmoe.train.profiling import ProfileWindow
from maxmoe.train.reporting import log, log_window, logging_hooks, metric_sinks, side_work
from maxmoe.train.saved_steps import check_resumable
from maxmoe.train.setup import RunSetup, prepare_run

# (setup, compiled first step, compile seconds, run_dir=) -> seconds it took; see `train`
FirstCompiled = Callable[..., float]


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


def _open_run_dir(cfg: Config) -> Path:
    """The run directory, created with the resolved config in it (by process 0)."""
    run_dir = Path(cfg.run.dir).resolve()
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    return run_dir


def _resume(ckpt: Checkpointer, setup: RunSetup, dataset, layout: dict, config_json: dict,
            init: InitSource | None):
    """(state, start step, data iterator, seconds the restore took or None): the newest
    checkpoint that reads back, else a fresh state at step 0 (with train.init_from's weights
    where it is set; `init`: that checkpoint, if already opened)."""
    t = time.perf_counter()
    cfg, trainer = setup.cfg, setup.trainer
    resumed = ckpt.resume(trainer.abstract_state, lambda: iter(dataset), layout, config_json)
    for bad, why in zip(resumed.quarantined, resumed.reasons, strict=True) if resumed else []:
        log(f"warning: checkpoint step {bad.name} could not be restored ({why}); moved it "
            f"to {bad}")
    if resumed is None and cfg.train.init_from:
        init = init or _open_init(cfg)
        return initial_state(trainer, cfg, init, log), 0, iter(dataset), None
    if resumed is None:
        return trainer.init(), 0, iter(dataset), None
    state, start, data_iter = resumed.state, resumed.step, resumed.data_iterator
    resume_s = time.perf_counter() - t
    ignored = (f"; train.init_from={cfg.train.init_from} not read: the run's own checkpoints "
               "win" if cfg.train.init_from else "")
    log(f"resumed from {ckpt.directory / str(start)} in {resume_s:.1f}s{ignored}")
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


def _open_init(cfg: Config) -> InitSource:
    """train.init_from's checkpoint, its architecture checked (ConfigError), warnings logged."""
    init = open_init_source(cfg)
    for warning in init.warnings:
        log(warning)
    return init


def train(cfg: Config, mesh_sizes: dict[str, int],
          first_compiled: FirstCompiled | None = None, started: float | None = None) -> dict:
    """Trains to cfg.train.steps (resuming from the run directory, else starting from
    train.init_from's weights where set); returns a summary.
    first_compiled: run by process 0 once the first step compiled (`maxmoe train` writes
    <run.dir>/plan.json with it); its seconds are the summary's plan_json_s.
    started: when the process started (epoch seconds; default now), goodput's startup."""
    started = time.time() if started is None else started
    # every check before the first write: a refused start leaves run.dir as it was (a bad
    # --cluster spec fails in `maxmoe train`, which builds first_compiled, before this)
    check_wandb(cfg.logging)  # W&B asked for without its package
    # a train.init_from that does not match (unless the run's own checkpoints win)
    init = _open_init(cfg) if needs_init_from(cfg) else None
    setup = prepare_run(cfg, mesh_sizes)
    layout, config_json = data_layout(cfg), to_dict(cfg)
    ckpt_dir = Path(cfg.run.dir).resolve() / "checkpoints"
    check_resumable(ckpt_dir, setup.trainer.abstract_state, config_json)  # another layout
    tokenizer = model_tokenizer(cfg)  # may train one (into the cache): after the cheap checks
    dataset = make_dataset(cfg.data, tokenizer, process_index=jax.process_index(),
                           process_count=jax.process_count())
    run_dir = _open_run_dir(cfg)
    if jax.process_index() == 0:  # generate and eval open <run.dir>/tokenizer
        save_tokenizer(tokenizer, run_dir / RUN_TOKENIZER_DIR)
    ckpt = Checkpointer(ckpt_dir, cfg.checkpoint)
    preemption = _Preemption(ckpt)  # from here on, SIGTERM means: save after the next step
    state, start, data_iter, resume_s = _resume(ckpt, setup, dataset, layout, config_json, init)
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
    sinks = metric_sinks(cfg, run_dir, start) if jax.process_index() == 0 else []
    loop = _Loop(setup, ckpt, data_iter, preemption, log_window(setup),
                 Goodput(run_dir if jax.process_index() == 0 else None, started))
    loop.guard.events = EventLog(run_dir / "events.jsonl" if jax.process_index() == 0 else None)
    if jax.process_index() == 0 and first_compiled is not None:
        loop.first_compiled = functools.partial(first_compiled, run_dir=run_dir)
    loop.profile = ProfileWindow.from_config(cfg, run_dir, start + 1, log)
    loop.hooks += [
        *([Hook(cfg.train.eval_every_steps, loop.evaluator(tokenizer), reads_state=True)]
          if cfg.train.eval_every_steps else []),
        *logging_hooks(cfg.logging.every_steps, setup.tokens_per_step, sinks),
        Hook(cfg.checkpoint.every_steps if cfg.checkpoint.enabled else 0,
             loop.saver(config_json, layout), at_end=True, reads_state=True),
        Hook(cfg.logging.every_steps, lambda _: loop.goodput.save(), at_end=True),
    ]
    summary = {"start_step": start, "first_loss": None, "preempted": False, "resume_s": resume_s,
               "save_blocking_s": loop.save_blocking_s, "plan_json_s": None}
    try:
        final_step = loop.run(state, start, summary)
    finally:
        preemption.restore()
        if loop.profile is not None:
            loop.profile.close()  # a window cut short (SIGTERM, a guard's stop)
        for sink in sinks:
            sink.close()
        loop.guard.events.close()
        ckpt.close()
        data_iter.close()  # stops the prefetch thread
        loop.goodput.save()
    summary.update(goodput_summary(run_dir, loop.goodput))
    rec = loop.window.last  # the newest logged step's figures
    if rec is not None:
        summary.update(last_loss=float(rec["loss"]), tokens_per_second=rec["tokens_per_second"],
                       mfu=rec.get("mfu"), host_overhead_fraction=rec.get("host_overhead_fraction"))
    summary["final_step"] = final_step
    return summary


class _Loop:
    """The steps of one run: dispatch, guards one step late, hooks (module docstring)."""

    def __init__(self, setup: RunSetup, ckpt: Checkpointer, data_iter, preemption: _Preemption,
                 window: LogWindow, goodput: Goodput):
        self.setup, self.trainer, self.ckpt = setup, setup.trainer, ckpt
        self.data_iter, self.preemption, self.window = data_iter, preemption, window
        self.timing = window.timing
        self.guard = Guard(setup.cfg.guard, log, moe_layers=moe_layer_indices(setup.cfg.model))
        self.hooks: list[Hook] = []
        self.save_blocking_s: list[float] = []
        self.t0 = 0.0  # when the loop started: the first step's compile time counts from it
        self.first_compiled: Callable | None = None  # train's first_compiled, run_dir bound
        self.profile: ProfileWindow | None = None  # logging.profile_start's trace window
        self.goodput = goodput  # where the attempt's time goes (files on process 0 only)

    def evaluator(self, tokenizer) -> Callable[[StepEnd], None]:
        """The eval hook: the validation loss of the step's state into `event.extra`."""
        evaluate = Evaluator(self.setup.cfg, self.trainer, tokenizer)

        def run_eval(event: StepEnd) -> None:
            t = time.perf_counter()
            event.extra[EVAL_LOSS] = evaluate(event.state).loss
            seconds = time.perf_counter() - t
            self.goodput.add("eval", seconds)
            self.window.excluded_s += seconds  # not training time: kept out of tokens/s
            event.extra["eval_time_s"] = seconds  # its own figure (the first one compiles)
            self.timing.busy_now()
            log(f"step {event.step}: eval loss {event.extra[EVAL_LOSS]:.4f} ({seconds:.1f} s)")
        return run_eval

    def saver(self, config_json: dict, layout: dict) -> Callable[[StepEnd], None]:
        """The save hook: an async checkpoint (forced at the last step), with the eval loss
        that ranks it for checkpoint.keep_best."""
        def save(event: StepEnd) -> None:
            t = time.perf_counter()
            # the iterator has handed out exactly `step` batches: the next one is fetched after
            saved = self.ckpt.save(event.step, event.state, self.data_iter, force=event.last,
                                   config=config_json, meta=layout, metrics=event.extra or None)
            blocked = time.perf_counter() - t
            self.goodput.add("checkpoint", blocked)
            if saved:
                self.save_blocking_s.append(round(blocked, 3))
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
        self.goodput.finished(event.step)
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
        JAX's cache: no second compile), runs `first_compiled` on it, and with several
        processes waits until every one has compiled: their first collective must meet within
        Gloo's fixed 30 s on CPU, less than the compile-time skew of a loaded host."""
        t = time.perf_counter()
        with use_mesh(self.trainer.mesh, self.trainer.rules):
            compiled = self.trainer.jitted_step.lower(state, batch).compile()
        self.goodput.add("compile", time.perf_counter() - t)
        if self.profile is not None:
            self.profile.compiled = compiled  # its HLO names the traced ops
        if self.first_compiled is not None:
            compile_s = time.perf_counter() - t
            seconds = side_work("plan.json", self.setup.cfg.logging.side_work_timeout_s,
                                lambda: self.first_compiled(self.setup, compiled, compile_s))
            summary["plan_json_s"] = None if seconds is None else round(seconds, 3)
        if jax.process_count() > 1:
            wait_for_processes("maxmoe_first_step_compiled",
                               self.setup.cfg.distributed.initialization_timeout_s)

    def dispatch(self, state, batch, done: int):
        """Dispatches step `done` (1-based) -> (state, metrics), not waiting for it; the
        profiling window starts before its first step and stops after its last, waiting for
        whole steps. Those waits are device time; reading the trace back is not training time."""
        profile, timing = self.profile, self.timing
        if profile is not None and profile.before(done, state):
            timing.busy_now()
        timing.dispatching()
        state, metrics = self.trainer.step(state, batch)
        timing.dispatched(metrics)
        if profile is not None and (spent := profile.after(done, (state, metrics))) is not None:
            timing.busy_now()
            if self.window.started is not None:  # else no window is open to keep it out of
                self.window.excluded_s += spent
        return state, metrics

    def next_batch(self):
        t = time.perf_counter()
        batch = global_batch(self.timing.next_batch(self.data_iter), self.trainer.batch_sharding)
        self.goodput.add("data_wait", time.perf_counter() - t)
        return batch

    def run(self, state, start: int, summary: dict) -> int:
        """Steps from `start` to train.steps (or a SIGTERM); returns the last step done.

        One step late: step N is dispatched before step N-1's metrics are read, so the device
        runs step N while the host settles N-1 (guards, logging). A step whose state a hook
        reads, the first and the last are settled before anything else happens."""
        total, timing, goodput = self.setup.cfg.train.steps, self.timing, self.goodput
        self.t0 = time.perf_counter()
        goodput.add("startup", time.time() - goodput.started)
        step, batch, pending = start, self.next_batch(), None
        self.compile_first(state, batch, summary)
        goodput.lap(step)  # laps from here on: one loop iteration each
        while step < total:  # a guard rollback moves `step` back
            if batch is None:
                batch = self.next_batch()
            state, metrics = self.dispatch(state, batch, step + 1)
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
                    goodput.lap(done, wasted=True)
                    continue
                self.finish(StepEnd(done - 1, False, host, self.window), summary)
            if last or self.reads_state(done):
                # its state is read now: settle it first, so a bad state is never saved
                host, restored = self.settle(done, metrics)
                if restored is not None:
                    state, step = restored
                    goodput.lap(done, wasted=True)
                    continue
                self.finish(StepEnd(done, last, host, self.window, state), summary)
                if stop:
                    summary["preempted"] = done < total
                    log(f"SIGTERM: saved step {done}, exiting")
                    goodput.lap(done)
                    break
            else:
                pending = (done, metrics)
            step = done
            if step < total:
                batch = self.next_batch()  # sharded while step `done` runs
            goodput.lap(done)
        return done
