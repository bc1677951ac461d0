"""Training input over prepared ArrayRecord shards: packing, attention mask, resume, mixtures."""

import dataclasses
import json
import random

import numpy as np
import pytest

from maxmoe.config import ConfigError, DataConfig
from maxmoe.data.executors import LaunchOptions
from maxmoe.data.pipeline import make_dataset, padding_fraction
from maxmoe.data.prepare import PrepareOptions, prepare
from maxmoe.data.tokenizer import load_tokenizer

from .conftest import english, read_split

# Concat-then-split packing only pads the last rows of a finite stream; in training it
# wastes nothing. Stated bound for the tests below:
MAX_PADDING_FRACTION = 0.01


def _prepare(directory, texts, tokenizer_dir, **options):
    directory.mkdir(exist_ok=True)
    (directory / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare([str(directory / "docs.jsonl")], str(tokenizer_dir), str(directory / "out"),
            PrepareOptions(launch=LaunchOptions(workers=1), **options))
    return directory / "out"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tokenizer_dir):
    rng = random.Random(5)
    # lengths from a few tokens to several rows, so packing both fills and splits rows
    texts = [f"doc {i}: " + english(rng, rng.choice([2, 10, 40, 150])) for i in range(300)]
    out = _prepare(tmp_path_factory.mktemp("prepared"), texts, tokenizer_dir,
                   validation_fraction=0.1)
    cfg = DataConfig(source=str(out), seq_len=64, global_batch_size=4, seed=7, streams=1)
    return cfg, load_tokenizer(cfg, 384)


def _take(dataset_or_iterator, count=None):
    iterator = iter(dataset_or_iterator)
    return list(iterator) if count is None else [next(iterator) for _ in range(count)]


def _documents(batches, eos_id):
    """(decodable) token lists of the complete documents in a batch stream."""
    stream = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in batches])
    ends = np.flatnonzero(stream == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [stream[s:e] for s, e in zip(starts, ends, strict=True)]


def test_tokenizer_comes_from_the_prepared_folder(prepared):
    cfg, tokenizer = prepared
    assert tokenizer.path.startswith(cfg.source)
    with pytest.raises(ConfigError, match="model.vocab_size"):
        load_tokenizer(cfg, 256)  # fewer ids than the tokenizer has


def test_attention_never_crosses_documents_and_little_waste(prepared):
    """Over 40 batches of prepared shards: the attention mask equals the one derived from the
    tokens alone (causal, within a document: a new one starts after each EOS, padding excluded),
    positions restart at each document, the mean padding fraction stays under
    MAX_PADDING_FRACTION, and the documents decode to what prepare wrote."""
    from maxmoe.kernels.attention import attention_mask

    cfg, tokenizer = prepared
    batches = _take(make_dataset(cfg, tokenizer), 40)
    for batch in batches:
        mask = np.asarray(attention_mask(batch["segment_ids"]))[:, 0, 0]  # [b, S, S]
        for row in range(batch["tokens"].shape[0]):
            tokens, segments = batch["tokens"][row], batch["segment_ids"][row]
            # ground truth from the tokens alone: a new document starts after every eos
            document = np.concatenate([[0], np.cumsum(tokens[:-1] == tokenizer.eos_id)])
            real = segments > 0
            same = document[:, None] == document[None, :]
            causal = np.tril(np.ones_like(same))
            allowed = same & causal & real[:, None] & real[None, :]
            np.testing.assert_array_equal(mask[row][real][:, real], allowed[real][:, real])
            # positions restart at each document, so RoPE never sees a cross-document offset
            for d in np.unique(document[real]):
                np.testing.assert_array_equal(batch["positions"][row][real & (document == d)],
                                              np.arange((real & (document == d)).sum()))
    waste = np.mean([padding_fraction(b) for b in batches])
    print(f"prepared-data padding fraction: {waste:.4f}")
    assert waste < MAX_PADDING_FRACTION
    # every token of a document is there: documents decode to what prepare wrote
    written = set(read_split(cfg.source, "train", tokenizer))
    decoded = [tokenizer.decode(d) for d in _documents(batches, tokenizer.eos_id)]
    assert decoded and set(decoded) <= written


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_gives_identical_next_batches(prepared, num_workers):
    if num_workers:
        from absl import flags

        flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags (RUNTIME_FACTS)
    cfg, tokenizer = prepared
    cfg = dataclasses.replace(cfg, num_workers=num_workers)
    iterator = iter(make_dataset(cfg, tokenizer))
    _take(iterator, 7)
    state = json.loads(json.dumps(iterator.get_state()))  # checkpoints store it as JSON
    expected = _take(iterator, 5)
    resumed = iter(make_dataset(cfg, tokenizer))
    resumed.set_state(state)
    for a, b in zip(expected, _take(resumed, 5), strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    other_seed = _take(make_dataset(dataclasses.replace(cfg, seed=8), tokenizer), 5)
    assert not all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(expected, other_seed, strict=True))


def test_processes_read_disjoint_shares_and_validation_is_held_out(prepared):
    cfg, tokenizer = prepared
    shares = []
    for index in range(2):
        batches = _take(make_dataset(cfg, tokenizer, process_index=index, process_count=2,
                                     num_epochs=1))
        shares.append({tokenizer.decode(d) for d in _documents(batches, tokenizer.eos_id)})
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    train = set(read_split(cfg.source, "train", tokenizer))
    assert len(shares[0] | shares[1]) > 0.9 * len(train)
    validation = _take(make_dataset(cfg, tokenizer, split="validation"))
    held_out = {tokenizer.decode(d) for d in _documents(validation, tokenizer.eos_id)}
    assert held_out == set(read_split(cfg.source, "validation", tokenizer))
    assert held_out and not held_out & train


def test_mixture_gives_each_dataset_its_token_share(tmp_path, tokenizer_dir, prepared):
    """data.mixture weights are token shares: a dataset of short documents weighted 0.7 against
    one of long documents weighted 0.3 gives the short one 0.7 of the tokens read (60 batches)
    within 0.05 absolute. A mixture entry without a weight and a folder that is not a finished
    prepare run are ConfigErrors."""
    rng = random.Random(6)
    # short documents in one dataset, long ones in the other: weights must be token shares
    short = _prepare(tmp_path / "short", [f"short {i} " + english(rng, 10) for i in range(200)],
                     tokenizer_dir)
    long = _prepare(tmp_path / "long", [f"long {i} " + english(rng, 120) for i in range(100)],
                    tokenizer_dir)
    cfg = DataConfig(mixture=f"{short}:0.7, {long}:0.3", seq_len=64, global_batch_size=8,
                     streams=1)  # documents are decoded from consecutive rows
    tokenizer = load_tokenizer(cfg, 384)
    batches = _take(make_dataset(cfg, tokenizer), 60)
    counts = {"short": 0, "long": 0}
    for document in _documents(batches, tokenizer.eos_id):
        counts[tokenizer.decode(document).split()[0]] += len(document) + 1
    share = counts["short"] / sum(counts.values())
    print(f"short-document token share {share:.3f} (weight 0.7)")
    assert abs(share - 0.7) < 0.05

    with pytest.raises(ConfigError, match="data.mixture"):
        make_dataset(dataclasses.replace(cfg, mixture=f"{short}:0.7,{long}"), tokenizer)
    with pytest.raises(ConfigError, match="not a finished"):
        make_dataset(dataclasses.replace(cfg, mixture=f"{short}:1,{tmp_path}:1"), tokenizer)
    _, other_tokenizer = prepared  # same model file contents: accepted
    assert other_tokenizer.vocab_size == tokenizer.vocab_size


def test_wrong_tokenizer_is_refused(prepared, tmp_path):
    from maxmoe.data.tokenizer import (
        MODEL_FILE,
        SentencePieceTokenizer,
        sentence_chunks,
        train_model,
    )

    cfg, _ = prepared
    rng = random.Random(9)
    text = "\n".join(english(rng, 30) + f" another corpus {i}" for i in range(300))
    model = train_model(sentence_chunks(text), 300, problem_key="test", sample="test")
    (tmp_path / MODEL_FILE).write_bytes(model)
    with pytest.raises(ConfigError, match="not the one"):
        make_dataset(cfg, SentencePieceTokenizer(tmp_path / MODEL_FILE))
