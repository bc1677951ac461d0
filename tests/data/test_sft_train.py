"""`maxmoe train configs/tiny.yaml data.format=sft ...` end to end, with a Hugging Face
tokenizer (smaller than model.vocab_size) and a chat template.

Every answer is the same word while every question is random word salad, so a loss that counts
only the answer tokens (the answer, <|im_end|>, newline: fully predictable after the prompt's
"<|im_start|>assistant\\n") can fall towards 0, while one that also counted question tokens
could not fall below their entropy: 12 words drawn uniformly from 95 common ones are
ln(95) = 4.55 nats a word, over half of every record's tokens, so at least ~2 nats/token.
Property: ce_loss starts above 5 and ends below 1 nat after 20 steps, a bound only an
answers-only loss can meet. Measured curve: docs/performance/data.md, "SFT loss on answers
only".
"""

import json
import random

import pytest

from maxmoe.cli import main
from maxmoe.data.tokenizer import open_tokenizer
from tests.data.conftest import CHATML_TEMPLATE, ENGLISH, english, write_hf_tokenizer

SMALL = ["model.vocab_size=512", "model.hidden_size=64", "model.num_layers=2",
         "model.dense_mlp_size=128", "attention.head_dim=16", "moe.expert_mlp_size=32",
         "mesh.data=8", "mesh.fsdp=1", "mesh.expert=1", "data.seq_len=64",
         "data.global_batch_size=16", "optimizer.warmup_steps=5", "optimizer.learning_rate=1e-2"]


@pytest.mark.slow
def test_sft_run_trains_on_answers_only(tmp_path):
    tokenizer_dir = write_hf_tokenizer(tmp_path / "tokenizer", chat_template=CHATML_TEMPLATE)
    rng = random.Random(0)
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": english(rng, 12)},
        {"role": "assistant", "content": "yes"}]}) + "\n" for _ in range(200)))
    run = tmp_path / "run"
    assert main(["train", "configs/tiny.yaml", "data.format=sft", f"data.source={chat}",
                 f"data.tokenizer_dir={tokenizer_dir}", f"run.dir={run}", "train.steps=20",
                 "train.eval_every_steps=0", "checkpoint.enabled=false", "logging.every_steps=1",
                 "logging.progress_bar=false", *SMALL]) == 0
    losses = [json.loads(line)["ce_loss"] for line in (run / "metrics.jsonl").open()]
    assert len(ENGLISH) == 95
    assert losses[0] > 5.0 and losses[-1] < 1.0, losses  # the bound: module docstring
    saved = open_tokenizer(run / "tokenizer")  # the run's tokenizer, for generate and eval
    assert saved.chat_template == CHATML_TEMPLATE and saved.sha256 == open_tokenizer(
        tokenizer_dir).sha256
