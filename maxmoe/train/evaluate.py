"""Held-out loss of a model: the in-loop evaluation and `maxmoe eval` run this one code path.

`Evaluator(cfg, trainer, tokenizer)(state)` reads the first train.eval_batches batches of the
validation split (the same ones on every call), runs one compiled forward per batch and returns
an `Evaluation`: the next-token cross-entropy summed over every real target token of those
batches divided by their count (token-weighted: a batch with padding rows or fewer loss tokens
counts less; the auxiliary MoE losses are not a language metric), its perplexity and the
throughput. `state` is a train
state or any dict with its "params" (and "buffers", the router bias, where the model has them),
so a full state in the loop and a params-only restore (`evaluate_checkpoint`) give the same
figures bit for bit on the same mesh: same batches, same compiled function, same inputs.

`find_checkpoint` and `evaluate_checkpoint` are what `maxmoe eval` runs on a run directory or a
checkpoint step directory.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from maxmoe.config import Config, ConfigError, fail
from maxmoe.data.pipeline import batch_spec, make_dataset
from maxmoe.data.tokenizer import RUN_TOKENIZER_DIR, load_tokenizer
from maxmoe.model.transformer import LossShare, loss_token_counts
from maxmoe.sharding import global_batch, use_mesh
from maxmoe.train.saved_steps import restore_params
from maxmoe.train.setup import RunSetup


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What one evaluation measured."""
    loss: float  # next-token cross-entropy summed over all loss tokens / their count, nats
    batches: int  # global batches run (fewer than asked when every process's split ends first)
    tokens: int  # positions run through the model: batches x global batch x seq_len
    seconds: float  # wall time of the batches (reading data included), compile excluded
    compile_seconds: float  # compiling the forward on this call (0.0 once compiled)
    loss_tokens: int = 0  # real target tokens the loss averages over (loss_mask's sum)

    @property
    def perplexity(self) -> float:
        """exp(loss): inf where the loss overflows it (an untrained or broken model)."""
        return math.inf if self.loss > 700 else math.exp(self.loss)  # NaN stays NaN

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Evaluator:
    """`evaluator(state) -> Evaluation` over cfg.train.eval_batches batches of `split`.

    The forward is compiled on the first call (timed apart, in `compile_seconds`) and reused;
    every call reads the split from its start, so repeated calls see the same batches."""

    def __init__(self, cfg: Config, trainer, tokenizer, split: str = "validation"):
        self.cfg, self.trainer = cfg, trainer
        self.dataset = make_dataset(cfg.data, tokenizer, split=split, num_epochs=1,
                                    process_index=jax.process_index(),
                                    process_count=jax.process_count())
        self._compiled = None

        mtp_depth = cfg.model.mtp_depth

        def batch_loss(params, buffers, batch):
            """(summed CE over the batch's loss tokens, their count), float32: a LossShare of
            denominator 1 turns the model's mean into the sum (one compiled forward)."""
            share = LossShare(jnp.ones((1 + mtp_depth,), jnp.float32), 1)
            model = nnx.merge(trainer.graphdef, params, *buffers)
            return model.loss(batch, share)[1]["ce_loss"], loss_token_counts(batch, 0)[0]

        self._batch_loss = jax.jit(batch_loss)

    def __call__(self, state) -> Evaluation:
        params, buffers = state["params"], (state["buffers"],) if "buffers" in state else ()
        sums, compile_s = [], 0.0
        t = time.perf_counter()
        with use_mesh(self.trainer.mesh, self.trainer.rules):
            for local in self._batches():
                batch = global_batch(local, self.trainer.batch_sharding)
                if self._compiled is None:
                    c = time.perf_counter()
                    self._compiled = self._batch_loss.lower(params, buffers, batch).compile()
                    compile_s = time.perf_counter() - c
                sums.append(self._compiled(params, buffers, batch))
            total, count = np.asarray(jax.device_get(sums), np.float64).reshape(-1, 2).sum(0)
        loss = float(total / count) if count > 0 else math.nan  # no batch or no loss token
        seconds = time.perf_counter() - t - compile_s
        tokens = len(sums) * self.cfg.data.global_batch_size * self.cfg.data.seq_len
        return Evaluation(loss, len(sums), tokens, seconds, compile_s, int(count))


    def _batches(self):
        """This process's local batches, as many on every process: up to train.eval_batches,
        while any process still has one; a process whose split ran out feeds empty rows
        (loss_mask 0, which count for nothing) so every process joins each global forward."""
        rows = iter(self.dataset)
        empty = {k: np.zeros(shape, dtype) for k, (shape, dtype) in
                 batch_spec(self.cfg.data, jax.process_count()).items()}
        for _ in range(self.cfg.train.eval_batches):
            local = next(rows, None)
            if not _any_process(local is not None):
                return
            yield empty if local is None else local


def _any_process(mine: bool) -> bool:
    """Whether `mine` is true on any process (every process must call it)."""
    if jax.process_count() == 1:
        return mine
    return bool(np.any(multihost_utils.process_allgather(np.int32(mine))))


def model_tokenizer(cfg: Config):
    """The tokenizer of cfg.data; a vocabulary larger than the model's is a config error (a
    smaller one is fine: released models pad their embeddings)."""
    tokenizer = load_tokenizer(cfg.data, cfg.model.vocab_size)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        fail("model.vocab_size", cfg.model.vocab_size, None, f"the tokenizer at {tokenizer.path} "
             f"has {tokenizer.vocab_size} tokens, more than the model's {cfg.model.vocab_size}",
             f"set model.vocab_size to at least {tokenizer.vocab_size} or clear "
             "data.tokenizer_dir")
    return tokenizer


def find_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """A run directory (its newest committed step) or one step directory (`<run>/checkpoints/
    <step>`) -> (run directory, step directory). Raises a one-line ConfigError otherwise.

    Steps are the all-digit folders: Orbax names a save in progress `<step>.orbax-checkpoint-
    tmp-*` until it commits, so a run still training can be evaluated as it goes."""
    given = Path(path).expanduser().resolve()
    if not given.is_dir():
        raise ConfigError(f"checkpoint {str(path)!r}: no such directory; pass a run directory "
                          "(run.dir of `maxmoe train`) or one of its checkpoints/<step> folders")
    if given.name.isdigit() and (given / "state").is_dir():
        return given.parent.parent, given
    steps = sorted((p for p in (given / "checkpoints").glob("*") if p.name.isdigit()
                    and (p / "state").is_dir()), key=lambda p: int(p.name))
    if not steps:
        raise ConfigError(f"checkpoint {str(path)!r}: holds no committed checkpoint (no "
                          f"checkpoints/<step>/state); train it with checkpoint.enabled=true, "
                          "or pass a checkpoints/<step> folder")
    return given, steps[-1]


def run_config_file(run_dir: Path, step_dir: Path) -> Path:
    """The config a checkpoint was trained with: <run>/config.yaml, else the step's own saved
    config (JSON, which YAML reads) when the step folder was copied away from its run."""
    for candidate in (run_dir / "config.yaml", step_dir / "config" / "metadata"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"checkpoint {str(step_dir)!r}: found neither {run_dir / 'config.yaml'} "
                      "nor a saved config in the step; pass the run directory `maxmoe train` "
                      "wrote")


def evaluate_checkpoint(setup: RunSetup, step_dir: Path, tokenizer,
                        split: str = "validation") -> Evaluation:
    """Restores the params (and router buffers) of `step_dir` onto setup's mesh and evaluates
    them with the Evaluator the train loop uses; reads no optimizer state and writes nothing
    (safe next to a job still training into the same directory)."""
    params = restore_params(step_dir, setup.trainer.abstract_state)
    evaluator = Evaluator(setup.cfg, setup.trainer, tokenizer, split)
    return evaluator(params)


def eval_tokenizer(run_cfg: Config, cfg: Config, run_dir: Path | None = None):
    """The model's tokenizer for evaluating `cfg`'s data: the one the run trained with (cfg's
    data.tokenizer_dir where that is set, else the copy in <run_dir>/tokenizer that training
    saved, else run_cfg.data's), never one trained anew on the evaluation source. (A prepared
    source tokenized with another one fails in the pipeline.)"""
    saved = run_dir / RUN_TOKENIZER_DIR if run_dir is not None else None
    directory = cfg.data.tokenizer_dir or (str(saved) if saved and any(saved.glob("*")) else "")
    data = dataclasses.replace(run_cfg.data, tokenizer_dir=directory)
    return model_tokenizer(dataclasses.replace(run_cfg, data=data))
