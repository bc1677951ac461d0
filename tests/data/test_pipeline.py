"""Data input: corpus listing and split, tokenizer training and caching, packed grain batches."""

import dataclasses
import json
import os
import random
import time

import numpy as np
import pytest

from maxmoe.config import ConfigError, DataConfig
from maxmoe.data import corpus
from maxmoe.data.pipeline import batch_spec, documents_for, make_dataset, padding_fraction
from maxmoe.data.tokenizer import MODEL_FILE, load_tokenizer

WORDS = ("alpha beta gamma delta epsilon lambda def return class import self value index "
         "token expert router batch shard mesh axis layer norm").split()


def _document(i: int) -> str:
    rng = random.Random(i)
    # Lengths from a few tokens to several rows, so packing both fills and splits rows.
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
             for _ in range(rng.choice([1, 2, 5, 20, 40]))]
    body = "\n".join("    " * rng.randint(0, 2) + line for line in lines)
    return f"doc {i}: {body}\n"  # the number makes every document's text unique


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    texts = {}
    for i in range(60):
        path = root / ("a" if i % 2 else "b/nested") / f"{i:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_document(i), encoding="utf-8")
        texts[str(path)] = _document(i)
    (root / "a" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8: skipped
    (root / "a" / "empty.txt").write_text("")  # no tokens: skipped
    return root, texts


@pytest.fixture(scope="module")
def text_setup(text_corpus, tmp_path_factory):
    root, texts = text_corpus
    cfg = DataConfig(source=str(root / "**" / "*.txt"), seq_len=32, global_batch_size=4,
                     validation_fraction=0.1, seed=3, streams=1)  # rows in order
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MAXMOE_CACHE", str(tmp_path_factory.mktemp("cache")))
        tokenizer = load_tokenizer(cfg, 384)
    return cfg, tokenizer, texts


def _take(dataset_or_iterator, count=None):
    iterator = iter(dataset_or_iterator)
    if count is None:
        return list(iterator)
    return [next(iterator) for _ in range(count)]


def _documents_in(batches, tokenizer):
    """Decoded texts of the complete documents (those ending in eos) in a batch stream."""
    stream = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in batches])
    ends = np.flatnonzero(stream == tokenizer.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(stream[s:e]) for s, e in zip(starts, ends, strict=True)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def test_listing_sorted_absolute_and_clear_error(text_corpus, tmp_path):
    """A corpus glob lists every document as a sorted absolute path; a glob that matches nothing
    is a ValueError saying so; a file that is not UTF-8 or is missing reads as None (skipped),
    not an error."""
    root, texts = text_corpus
    paths = corpus.list_documents(str(root / "**" / "*.txt"))
    assert paths == sorted(paths) and all(os.path.isabs(p) for p in paths)
    assert set(texts) <= set(paths) and len(paths) == len(texts) + 2
    with pytest.raises(ValueError, match="matches no files"):
        corpus.list_documents(str(tmp_path / "nothing" / "*.txt"))
    assert corpus.read_document(str(root / "a" / "latin1.txt")) is None
    assert corpus.read_document(str(tmp_path / "missing.txt")) is None


def test_stdlib_listing_skips_site_packages():
    paths = corpus.list_documents("stdlib")
    assert len(paths) > 500 and all(p.endswith(".py") for p in paths)
    assert not any(os.sep + "site-packages" + os.sep in p for p in paths)


def test_split_deterministic_disjoint_and_stable():
    paths = sorted(f"/corpus/{i}.txt" for i in range(400))
    train, validation = corpus.split_documents(paths, 0.1, seed=0)
    assert (train, validation) == corpus.split_documents(paths, 0.1, seed=0)
    assert not set(train) & set(validation) and sorted(train + validation) == paths
    assert 20 <= len(validation) <= 60
    assert corpus.split_documents(paths, 0.1, seed=1)[1] != validation
    # a new file joins one side without moving any other file across the split
    train2, validation2 = corpus.split_documents(paths + ["/corpus/new.txt"], 0.1, seed=0)
    assert set(validation) <= set(validation2) and set(train) <= set(train2)
    assert corpus.split_documents(paths[:3], 0.01, seed=0)[1]  # small corpora still hold one out


def test_tokenizer_cached_and_not_retrained(text_corpus, tmp_path, monkeypatch, capsys):
    root, _ = text_corpus
    monkeypatch.setenv("MAXMOE_CACHE", str(tmp_path))
    cfg = DataConfig(source=str(root / "**" / "*.txt"))
    first = load_tokenizer(cfg, 320)
    assert "trained" in capsys.readouterr().err
    assert first.path.startswith(str(tmp_path)) and first.vocab_size == 320
    assert (first.pad_id, first.eos_id) == (0, 3)
    modified = os.path.getmtime(first.path)
    second = load_tokenizer(cfg, 320)
    assert "trained" not in capsys.readouterr().err
    assert second.path == first.path and os.path.getmtime(second.path) == modified
    cache = os.path.dirname(os.path.dirname(first.path))
    assert not [p for p in os.listdir(cache) if p.startswith(".")]  # no staging debris
    # an explicit tokenizer_dir is loaded as is, and checked against the model's vocab size
    directory = os.path.dirname(first.path)
    assert load_tokenizer(dataclasses.replace(cfg, tokenizer_dir=directory), 320).path == first.path
    with pytest.raises(ConfigError, match="model.vocab_size"):
        load_tokenizer(dataclasses.replace(cfg, tokenizer_dir=directory), 256)
    # a model vocabulary larger than the tokenizer's is fine (released models pad it)
    assert load_tokenizer(dataclasses.replace(cfg, tokenizer_dir=directory), 512).vocab_size == 320
    with pytest.raises(ConfigError, match=MODEL_FILE):
        load_tokenizer(dataclasses.replace(cfg, tokenizer_dir=str(tmp_path / "none")), 320)


def test_stdlib_tokenizer_round_trip_and_batches(tmp_path, monkeypatch):
    monkeypatch.setenv("MAXMOE_CACHE", str(tmp_path))
    cfg = DataConfig(source="stdlib")
    tokenizer = load_tokenizer(cfg, 2048)
    paths = corpus.list_documents("stdlib")
    samples = [json.__file__.replace("__init__.py", "decoder.py"), paths[0], paths[len(paths) // 2]]
    for path in samples:
        text = corpus.read_document(path)
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert len(text.encode()) / max(len(ids), 1) > 2.0  # BPE compresses code
    weird = "tabs\tand  spaces\n\n    indent ünïcödé 😀 \r\n  trailing  "
    assert tokenizer.decode(tokenizer.encode(weird)) == weird  # byte fallback, no squeezing
    batches = _take(make_dataset(cfg, tokenizer), 50)
    spec = batch_spec(cfg)
    for key, (shape, dtype) in spec.items():
        assert batches[0][key].shape == shape and batches[0][key].dtype == dtype
    waste = np.mean([padding_fraction(b) for b in batches])
    print(f"stdlib padding fraction: {waste:.4f}")
    assert waste < 0.01


def test_packing_invariants(text_setup):
    """Every packed row: padding only at its end, segment ids counting up from 1 by at most 1,
    positions restarting at 0 in each document, loss_mask = (target != 0) and 0 on padding and
    at each EOS (no prediction across documents), targets = the next token inside a document and
    the next row's first token where a document runs off the row; the rows decode to
    training-split documents only, over 80% of them in one epoch."""
    cfg, tokenizer, texts = text_setup
    batches = _take(make_dataset(cfg, tokenizer, num_epochs=1))
    assert len(batches) > 10
    rows = [{k: b[k][r] for k in b} for b in batches for r in range(b["tokens"].shape[0])]
    for index, row in enumerate(rows):
        seg, pos, tok, tgt, mask = (row[k] for k in
                                    ("segment_ids", "positions", "tokens", "targets", "loss_mask"))
        used = seg > 0
        assert used[0] and np.all(used[:-1] >= used[1:])  # padding only at the end
        ids = seg[used]
        assert ids[0] == 1 and np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)
        for segment in np.unique(ids):
            np.testing.assert_array_equal(pos[seg == segment], np.arange((seg == segment).sum()))
        np.testing.assert_array_equal(mask, (tgt != 0).astype(np.float32))
        assert np.all(mask[~used] == 0) and np.all(tok[~used] == 0)
        assert np.all(mask[tok == tokenizer.eos_id] == 0)  # never predict across documents
        inside = (seg[:-1] == seg[1:]) & (mask[:-1] == 1)
        np.testing.assert_array_equal(tgt[:-1][inside], tok[1:][inside])
        # where a document runs off the row, its target is the first token of the next row
        if mask[-1] and index + 1 < len(rows):
            assert tgt[-1] == rows[index + 1]["tokens"][0] and rows[index + 1]["positions"][0] == 0
    train = set(documents_for(cfg, "train"))
    decoded = _documents_in(batches, tokenizer)
    assert set(decoded) <= {texts[p] for p in train if p in texts}
    assert len(decoded) > 0.8 * len(train)  # only the tail dropped with the partial last batch


def test_shapes_seed_and_epochs(text_setup):
    """Batches have batch_spec's shapes and dtypes for 1 and 2 processes; the same seed gives
    the same batches and another seed other ones; of two epochs the first holds every training
    document and the second (over 80% of them) comes in another order; a batch that does not
    split over 3 processes is a ConfigError naming global_batch_size."""
    cfg, tokenizer, texts = text_setup
    for process_count in (1, 2):
        batch = _take(make_dataset(cfg, tokenizer, process_count=process_count), 1)[0]
        for key, (shape, dtype) in batch_spec(cfg, process_count).items():
            assert batch[key].shape == shape and batch[key].dtype == dtype, key
    first = _take(make_dataset(cfg, tokenizer), 8)
    _assert_same(first, _take(make_dataset(cfg, tokenizer), 8))
    other = _take(make_dataset(dataclasses.replace(cfg, seed=4), tokenizer), 8)
    assert not all(np.array_equal(a["tokens"], b["tokens"]) for a, b in zip(first, other, strict=True))
    epoch = sorted(texts[p] for p in documents_for(cfg, "train") if p in texts)
    two = _documents_in(_take(make_dataset(cfg, tokenizer, num_epochs=2)), tokenizer)
    first, second = two[:len(epoch)], two[len(epoch):]
    assert sorted(first) == epoch and len(second) > 0.8 * len(epoch)
    assert second != first[:len(second)]  # each epoch has its own order
    with pytest.raises(ConfigError, match="global_batch_size"):
        make_dataset(cfg, tokenizer, process_count=3)


def test_process_shares_disjoint_and_covering(text_setup):
    cfg, tokenizer, texts = text_setup
    for split in ("train", "validation"):
        everything = documents_for(cfg, split)
        shares = [documents_for(cfg, split, i, 3) for i in range(3)]
        assert sorted(sum(shares, [])) == everything
        assert all(not set(a) & set(b) for i, a in enumerate(shares) for b in shares[i + 1:])
    for index in range(2):
        share = {texts[p] for p in documents_for(cfg, "train", index, 2) if p in texts}
        batches = _take(make_dataset(cfg, tokenizer, process_index=index, process_count=2), 30)
        assert set(_documents_in(batches, tokenizer)) <= share


def test_state_resumes_identically(text_setup):
    cfg, tokenizer, _ = text_setup
    iterator = iter(make_dataset(cfg, tokenizer))
    _take(iterator, 5)
    state = json.loads(json.dumps(iterator.get_state()))  # checkpoints store it as JSON
    expected = _take(iterator, 6)
    resumed = iter(make_dataset(cfg, tokenizer))
    resumed.set_state(state)
    _assert_same(expected, _take(resumed, 6))


def test_prefetch_state_is_the_consumed_position(text_setup):
    """The prefetch thread runs ahead, but get_state() is where next() has got to: the same
    state and batches as without prefetching, and a restore continues right there."""
    cfg, tokenizer, _ = text_setup
    plain = iter(make_dataset(dataclasses.replace(cfg, prefetch_batches=0), tokenizer))
    ahead = iter(make_dataset(dataclasses.replace(cfg, prefetch_batches=3), tokenizer))
    _assert_same(_take(plain, 5), _take(ahead, 5))
    deadline = time.monotonic() + 30
    # grain's queue, peeked at to know that the thread has run ahead
    while ahead._buffer.qsize() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ahead._buffer.qsize() == 3
    state = json.loads(json.dumps(ahead.get_state()))
    assert state == json.loads(json.dumps(plain.get_state()))
    expected = _take(plain, 4)
    resumed = iter(make_dataset(cfg, tokenizer))
    resumed.set_state(state)
    _assert_same(expected, _take(resumed, 4))
    ahead.set_state(state)  # the buffered batches are dropped, not handed out
    _assert_same(expected, _take(ahead, 4))
    for iterator in (plain, ahead, resumed):
        iterator.close()


def test_interleaved_streams_mix_documents_and_resume(text_setup):
    cfg, tokenizer, _ = text_setup
    ordered = _take(make_dataset(cfg, tokenizer), 12)
    mixed_cfg = dataclasses.replace(cfg, streams=3)
    mixed = _take(make_dataset(mixed_cfg, tokenizer), 12)
    def continued(batches):  # share of next rows that continue the previous row's document
        pairs = [(b, r) for b in batches for r in range(b["tokens"].shape[0] - 1)
                 if b["loss_mask"][r, -1]]
        return np.mean([b["targets"][r, -1] == b["tokens"][r + 1, 0] for b, r in pairs])

    # one stream: a long document fills consecutive rows; three streams: neighbours differ
    assert continued(ordered) > 0.5 and continued(mixed) < 0.2
    iterator = iter(make_dataset(mixed_cfg, tokenizer))
    _take(iterator, 5)
    state = json.loads(json.dumps(iterator.get_state()))
    expected = _take(iterator, 6)
    resumed = iter(make_dataset(mixed_cfg, tokenizer))
    resumed.set_state(state)
    _assert_same(expected, _take(resumed, 6))


@pytest.mark.parametrize("processes, streams", [(2, 2), (4, 1)])
def test_global_batch_independent_of_process_count(text_setup, processes, streams):
    """global_batch_size = processes x streams: the processes' batches, concatenated in
    process order (make_array_from_process_local_data's row order), equal one process's
    batches with processes x streams streams, row for row."""
    cfg, tokenizer, _ = text_setup
    total = processes * streams
    cfg = dataclasses.replace(cfg, global_batch_size=total)
    alone = _take(make_dataset(dataclasses.replace(cfg, streams=total), tokenizer), 8)
    shares = [_take(make_dataset(dataclasses.replace(cfg, streams=streams), tokenizer,
                                 process_index=i, process_count=processes), 8)
              for i in range(processes)]
    joined = [{k: np.concatenate([share[n][k] for share in shares]) for k in alone[n]}
              for n in range(8)]
    _assert_same(alone, joined)


def test_validation_finite_padded_and_disjoint(text_setup):
    """The validation split is finite (one pass, every validation document exactly once),
    disjoint from the training documents, [4, 32] per batch, and its last batch is padded
    (loss_mask not all ones)."""
    cfg, tokenizer, texts = text_setup
    batches = _take(make_dataset(cfg, tokenizer, split="validation"))
    assert batches and all(b["tokens"].shape == (4, 32) for b in batches)
    validation = documents_for(cfg, "validation")
    assert validation and not set(validation) & set(documents_for(cfg, "train"))
    assert sorted(_documents_in(batches, tokenizer)) == sorted(texts[p] for p in validation
                                                             if p in texts)
    assert batches[-1]["loss_mask"].sum() < batches[-1]["loss_mask"].size  # padded tail


def test_worker_processes_match_and_resume(text_setup):
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # grain's workers read absl flags (RUNTIME_FACTS)
    cfg, tokenizer, _ = text_setup
    parallel = dataclasses.replace(cfg, num_workers=2)
    iterator = iter(make_dataset(parallel, tokenizer))
    _take(iterator, 3)
    state = iterator.get_state()
    expected = _take(iterator, 4)
    resumed = iter(make_dataset(parallel, tokenizer))
    resumed.set_state(state)
    _assert_same(expected, _take(resumed, 4))
