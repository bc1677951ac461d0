"""`maxmoe data prepare`: dedup recall, filter counts, corrupt inputs, resumption."""

import gzip
import json
import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from maxmoe.config import ConfigError
from maxmoe.data import prepare as prepare_module, shards
from maxmoe.data.dedup import DedupOptions, shingle_hashes
from maxmoe.data.filters import FilterOptions
from maxmoe.data.prepare import PrepareOptions, prepare
from maxmoe.data.sources import InputOptions

from .conftest import distinct_document, english, german, read_split

QUIET = dict(progress=False, workers=1)


def _jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))


def _written(directory, tokenizer):
    return read_split(directory, "train", tokenizer) + read_split(directory, "validation",
                                                                  tokenizer)


def _edit(rng, text, edits):
    """An edited copy: word substitutions, deletions, insertions and punctuation changes."""
    words = text.split()
    for _ in range(edits):
        position = rng.randrange(len(words))
        kind = rng.choice(["substitute", "delete", "insert", "punctuate"])
        if kind == "substitute":
            words[position] = rng.choice(["edited", "changed", "typo", "new"])
        elif kind == "delete":
            del words[position]
        elif kind == "insert":
            words.insert(position, "inserted")
        else:
            words[position] = words[position].capitalize() + ","  # invisible to shingles
    return " ".join(words)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """200 distinct documents, then 60 edited copies (3 edits each) and 10 exact copies.

    40 of the distinct documents share their first 75% with another one (Jaccard about 0.6,
    below the 0.8 threshold): related, but not duplicates, so they must be kept.
    """
    rng = random.Random(1)
    originals = [distinct_document(rng, rng.randint(300, 400)) for _ in range(160)]
    for i in range(40):
        words = originals[100 + i].split()
        cut = 3 * len(words) // 4
        originals.append(" ".join(words[:cut] + distinct_document(rng, len(words) - cut).split()))
    edited = [_edit(rng, originals[i], 3) for i in range(60)]
    exact = originals[100:110]
    root = tmp_path_factory.mktemp("planted")
    _jsonl(root / "a_originals.jsonl", originals)  # read first: the originals are kept
    _jsonl(root / "b_copies.jsonl", edited + exact)
    return root, originals, edited


def test_near_duplicates_removed_distinct_kept(planted, tokenizer_dir, tokenizer, tmp_path):
    root, originals, edited = planted
    manifest = prepare([str(root)], str(tokenizer_dir), str(tmp_path / "out"),
                       PrepareOptions(**QUIET))
    written = _written(tmp_path / "out", tokenizer)
    assert set(originals) <= set(written)  # every distinct document kept
    surviving = [t for t in edited if t in written]
    recall = 1 - len(surviving) / len(edited)
    print(f"near-duplicate recall {recall:.3f}")
    assert recall >= 0.95
    assert len(written) == len(set(written)) == 200 + len(surviving)
    assert manifest["dropped"] == {"exact_duplicate": 10, "near_duplicate": 60 - len(surviving)}
    assert manifest["documents_read"] == 270

    # the control: without near dedup every edited copy survives (so recall measures LSH)
    control = prepare([str(root)], str(tokenizer_dir), str(tmp_path / "control"),
                      PrepareOptions(dedup=DedupOptions(near=False), **QUIET))
    assert control["dropped"] == {"exact_duplicate": 10}
    assert set(edited) <= set(_written(tmp_path / "control", tokenizer))


def test_shingles_ignore_case_and_punctuation_but_not_order():
    text = "the cat sat on the mat and looked at the dog"
    np.testing.assert_array_equal(shingle_hashes("The cat, sat on the MAT! and looked at "
                                                 "the dog", 5), shingle_hashes(text, 5))
    assert len(shingle_hashes(text, 5)) == 7
    assert len(shingle_hashes("two words", 5)) == 1
    swapped = shingle_hashes("cat the sat on the mat and looked at the dog", 5)
    assert len(np.intersect1d(swapped, shingle_hashes(text, 5))) == 5


def test_filters_count_what_they_drop(tokenizer_dir, tokenizer, tmp_path):
    rng = random.Random(2)
    keep = [english(rng, 80) for _ in range(30)]
    planted = {
        "language": [german(rng, 80) for _ in range(10)],
        "too_few_characters": ["the of and", "it was", "short", "to be", "we can"],
        "too_many_characters": [english(rng, 1500) for _ in range(3)],
        "too_many_tokens": [english(rng, 900)[:4900] for _ in range(3)],
        "empty": ["", "   ", "\n\n", "\t"],
        "exact_duplicate": keep[:2],
    }
    assert all(len(tokenizer.encode(t)) < 600 for t in keep)
    assert all(len(tokenizer.encode(t)) > 600 for t in planted["too_many_tokens"])
    documents = keep + [t for texts in planted.values() for t in texts]
    random.Random(3).shuffle(documents)
    keep_set = set(keep)
    # exact duplicates only count once their original has been seen: put originals first
    documents.sort(key=lambda t: t not in keep_set)
    _jsonl(tmp_path / "docs.jsonl", documents)
    options = PrepareOptions(filters=FilterOptions(
        min_characters=50, max_characters=5000, max_tokens=600, languages=("en",)), **QUIET)
    manifest = prepare([str(tmp_path / "docs.jsonl")], str(tokenizer_dir), str(tmp_path / "out"),
                       options)
    assert manifest["dropped"] == {reason: len(texts) for reason, texts in planted.items()}
    assert manifest["documents_read"] == len(documents)
    assert sorted(_written(tmp_path / "out", tokenizer)) == sorted(keep)
    written = manifest["documents_written"]
    assert written["train"] + written["validation"] == len(keep)


def test_corrupt_inputs_reported_and_skipped(tokenizer_dir, tokenizer, tmp_path):
    rng = random.Random(4)
    good = [english(rng, 40) for _ in range(10)]
    root = tmp_path / "in"
    root.mkdir()
    lines = [json.dumps({"text": good[0]}), "{not json", json.dumps({"body": "no text field"}),
             json.dumps({"text": good[1]})]
    (root / "mixed.jsonl").write_bytes("\n".join(lines).encode() + b'\n{"text": "caf\xe9"}\n')
    (root / "good.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(good[2].encode()))
    (root / "good.txt.gz").write_bytes(gzip.compress(good[3].encode()))
    pq.write_table(pa.table({"text": good[4:7]}), root / "good.parquet")
    (root / "plain.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in good[7:9]))
    table = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": good[9:]}), table)
    (root / "packed.parquet.zst").write_bytes(
        zstandard.ZstdCompressor().compress(table.getvalue().to_pybytes()))
    (root / "latin1.txt").write_bytes("café crème".encode("latin-1"))
    (root / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    # a gzip stream cut in half: the documents before the damage are still read
    stream = gzip.compress("".join(json.dumps({"text": english(rng, 30)}) + "\n"
                                   for _ in range(400)).encode(), mtime=0)
    (root / "truncated.jsonl.gz").write_bytes(stream[:len(stream) // 2])

    manifest = prepare([str(root)], str(tokenizer_dir), str(tmp_path / "out"),
                       PrepareOptions(dedup=DedupOptions(near=False), **QUIET))
    assert manifest["read_errors"] == {"bad_encoding": 2, "malformed_json": 1,
                                       "missing_field": 1, "unreadable_file": 2}
    examples = " ".join(manifest["read_error_examples"])
    assert "truncated.jsonl.gz" in examples and "broken.parquet" in examples
    assert "mixed.jsonl:2: malformed_json" in examples
    assert set(good) <= set(_written(tmp_path / "out", tokenizer))


def _shard_files(directory):
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir()
            if p.name.startswith(("train-", "validation-", "dedup-", "shard-"))}


def test_rerun_skips_finished_shards_and_matches_one_run(planted, tokenizer_dir, tokenizer,
                                                         tmp_path, monkeypatch):
    root, _, _ = planted
    options = PrepareOptions(shard_megabytes=0.02, validation_fraction=0.1, progress=False)
    # reference: one uninterrupted run, in two worker processes
    reference = prepare([str(root)], str(tokenizer_dir), str(tmp_path / "reference"),
                        PrepareOptions(**{**options.__dict__, "workers": 2}))
    assert len(reference["shards"]) >= 5

    out = tmp_path / "out"
    real_write = prepare_module._write_shard

    def crash_at_shard_3(directory, index, *args):
        if index == 3:
            raise KeyboardInterrupt  # the process is killed while shard 3 is written
        return real_write(directory, index, *args)

    monkeypatch.setattr(prepare_module, "_write_shard", crash_at_shard_3)
    single = PrepareOptions(**{**options.__dict__, "workers": 1})
    with pytest.raises(KeyboardInterrupt):
        prepare([str(root)], str(tokenizer_dir), str(out), single)
    assert not (out / shards.MANIFEST).exists()
    (out / "train-00003.array_record").write_bytes(b"half-written debris")
    before = _shard_files(out)
    assert {f"shard-{i:05d}.done.json" for i in range(3)} <= set(before)

    monkeypatch.setattr(prepare_module, "_write_shard", real_write)
    written_again = []
    monkeypatch.setattr(prepare_module, "_write_shard", lambda directory, index, *args: (
        written_again.append(index), real_write(directory, index, *args))[1])
    resumed = prepare([str(root)], str(tokenizer_dir), str(out), single)
    assert written_again == list(range(3, len(reference["shards"])))
    after = _shard_files(out)
    assert all(after[name] == before[name] for name in before
               if name.endswith(("-00000.array_record", "-00001.array_record",
                                 "-00002.array_record", ".done.json", ".npz"))
               and not name.startswith(("train-00003", "shard-00003", "dedup-00003")))
    assert {k: v for k, v in resumed.items() if k != "inputs"} == \
        {k: v for k, v in reference.items() if k != "inputs"}
    for split in shards.SPLITS:
        assert read_split(out, split, tokenizer) == read_split(tmp_path / "reference", split,
                                                               tokenizer)

    # other settings into the same folder: refused with the option to change named
    with pytest.raises(ConfigError, match="--out.*options"):
        prepare([str(root)], str(tokenizer_dir), str(out),
                PrepareOptions(**{**single.__dict__, "seed": 1}))
    assert os.path.isfile(out / shards.MANIFEST)


def test_input_listing_errors(tmp_path, tokenizer_dir):
    with pytest.raises(ConfigError, match="matches no files"):
        prepare([str(tmp_path / "none" / "*.jsonl")], str(tokenizer_dir), str(tmp_path / "o"))
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(ConfigError, match="--tokenizer"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path), str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="--minhash-threshold"):
        prepare([str(tmp_path / "a.txt")], str(tokenizer_dir), str(tmp_path / "o"),
                PrepareOptions(dedup=DedupOptions(threshold=1.5)))
    assert InputOptions().json_field == "text"
