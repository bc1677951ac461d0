"""`maxmoe eval` on two processes whose validation shares are uneven (text and SFT).

Property: every process runs the same number of global forwards (the most batches any process
has; a process whose split ran out feeds empty rows), so the job ends instead of hanging in a
forward that one process never joins; the result counts every process's rows: its loss-token
count is the sum of both shares' loss masks, and its loss equals one process on 8 devices
evaluating the same global batches (both shares' local batches side by side), within 1e-5
relative (the tolerance of the multi-process training test: float32 order).
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import jax
import numpy as np
import pytest

from maxmoe.config_files import load_config
from maxmoe.data.pipeline import batch_spec, make_dataset
from maxmoe.train import evaluate as ev
from maxmoe.train.saved_steps import restore_params
from maxmoe.train.setup import prepare_run
from maxmoe.validation import validate
from tests.data.conftest import CHATML_TEMPLATE, english, write_hf_tokenizer
from tests.distributed.test_multiprocess import (
    HEARTBEAT_S,
    START_S,
    Process,
    free_port,
    kill_left,
)
from tests.train.test_chaos import TINY

MODEL = [t for t in TINY if not t.startswith(("mesh.", "checkpoint."))] + [
    "mesh.data=2", "mesh.fsdp=2", "mesh.expert=2", "train.steps=1", "checkpoint.every_steps=1",
    "data.validation_fraction=0.2", "data.streams=2"]


def write_data(root: Path, kind: str) -> list[str]:
    """The data keys of a small corpus (text files, or chat records of growing length) whose
    validation split, strided over 2 processes, gives them different batch counts (the test
    checks that premise)."""
    rng = random.Random(0)
    tokenizer = write_hf_tokenizer(root / "tokenizer", chat_template=CHATML_TEMPLATE)
    if kind == "sft":
        chat = root / "chat.jsonl"
        chat.write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": english(rng, 10 + 15 * i)},
            {"role": "assistant", "content": english(rng, 20)}]}) + "\n" for i in range(15)))
        return ["data.format=sft", f"data.source={chat}", f"data.tokenizer_dir={tokenizer}"]
    (root / "corpus").mkdir()
    for i in range(15):
        (root / "corpus" / f"doc_{i:02d}.txt").write_text(english(rng, 100))
    return [f"data.source={root}/corpus/*.txt", f"data.tokenizer_dir={tokenizer}"]


def shares(cfg, tokenizer) -> list[list[dict]]:
    """Each of 2 processes' local validation batches."""
    return [list(make_dataset(cfg.data, tokenizer, split="validation", num_epochs=1,
                              process_index=i, process_count=2)) for i in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["text", "sft"])
def test_two_processes_with_uneven_validation_shares_evaluate_every_row(kind, tmp_path,
                                                                        monkeypatch):
    from maxmoe.cli import main

    monkeypatch.setenv("MAXMOE_CACHE", str(tmp_path / "cache"))
    data = write_data(tmp_path, kind)
    run = tmp_path / "run"
    assert main(["train", *MODEL, *data, f"run.dir={run}", "logging.progress_bar=false"]) == 0
    run_dir, step_dir = ev.find_checkpoint(run)
    cfg, origins = load_config([str(run_dir / "config.yaml")], ["train.eval_batches=1000"])
    tokenizer = ev.eval_tokenizer(cfg, cfg, run_dir)
    local = shares(cfg, tokenizer)
    counts = [len(s) for s in local]
    assert counts[0] != counts[1], counts  # the premise: uneven shares

    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # each process fakes its own 4 devices (mesh.cpu_devices)
    port = free_port()
    items = [str(run), "train.eval_batches=1000", "mesh.cpu_devices=4", "mesh.dcn_data=2",
             f"distributed.heartbeat_timeout_s={HEARTBEAT_S}"]
    processes = [Process(i, 2, port, items, env, verb="eval") for i in range(2)]
    try:
        codes = [p.proc.wait(timeout=START_S) for p in processes]
    finally:
        kill_left(processes)
    out = [p.text() for p in processes]
    assert codes == [0, 0], out[0][-3000:] + out[1][-3000:]
    (report,) = [json.loads(line) for line in out[0].splitlines() if line.startswith("{")]
    assert report["batches"] == max(counts)
    assert report["loss_tokens"] == sum(int(b["loss_mask"].sum()) for s in local for b in s)

    # reference: one process, 8 devices, the same global batches (rows of process 0, then 1)
    empty = {k: np.zeros(shape, dtype) for k, (shape, dtype) in batch_spec(cfg.data, 2).items()}
    rounds = [[s[n] if n < len(s) else empty for s in local] for n in range(max(counts))]
    setup = prepare_run(cfg, validate(cfg, 8, origins))
    evaluator = ev.Evaluator(cfg, setup.trainer, tokenizer)
    evaluator.dataset = [{k: np.concatenate([b[k] for b in pair]) for k in empty}
                         for pair in rounds]
    reference = evaluator(restore_params(step_dir, setup.trainer.abstract_state))
    assert reference.batches == max(counts) and reference.loss_tokens == report["loss_tokens"]
    assert math.isfinite(reference.loss)
    print(f"{kind}: batches per process {counts}; loss 2 x 4 {report['eval_loss']:.6f}, "
          f"1 x 8 {reference.loss:.6f}")
    np.testing.assert_allclose(report["eval_loss"], reference.loss, rtol=1e-5)
    assert jax.process_count() == 1
