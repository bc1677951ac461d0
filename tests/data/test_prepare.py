"""`maxmoe data prepare` on datatrove's local executor: dedup across tasks, filter counts,
decontamination, corrupt inputs, resumption of a failed task, Slurm scripts."""

import gzip
import json
import os
import random
import signal
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from maxmoe.config import ConfigError
from maxmoe.data import minhash, shards, stages as stages_module
from maxmoe.data.executors import LaunchOptions
from maxmoe.data.filters import FilterOptions
from maxmoe.data.prepare import PrepareOptions, prepare
from maxmoe.data.sources import InputOptions

from .conftest import distinct_document, english, german, read_split

# in this process (datatrove's local executor with one worker), two tasks per stage
QUIET = dict(tasks=2, launch=LaunchOptions(workers=1))


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
    """200 distinct documents, 60 edited copies (3 edits each) and 10 exact copies, in four
    files. With two tasks, task 0 reads a_0 and b_copies, task 1 a_1 and c_exact: half of
    the copies are in another task than their original, so dedup must work across tasks."""
    rng = random.Random(1)
    originals = [distinct_document(rng, rng.randint(300, 400)) for _ in range(200)]
    edited = [_edit(rng, originals[i], 3) for i in range(60)]
    exact = originals[100:110]
    root = tmp_path_factory.mktemp("planted")
    _jsonl(root / "a_0.jsonl", originals[0::2])
    _jsonl(root / "a_1.jsonl", originals[1::2])
    _jsonl(root / "b_copies.jsonl", edited)
    _jsonl(root / "c_exact.jsonl", exact)
    return root, originals, edited


def test_duplicates_removed_across_tasks(planted, tokenizer_dir, tokenizer, tmp_path):
    root, originals, edited = planted
    manifest = prepare([str(root)], str(tokenizer_dir), str(tmp_path / "out"),
                       PrepareOptions(**QUIET))
    written = _written(tmp_path / "out", tokenizer)
    assert len(written) == len(set(written))  # no two copies survive
    # every distinct document survives, as itself or as its edited copy (one per cluster)
    assert all(originals[i] in written or (i < 60 and edited[i] in written)
               for i in range(200))
    caught = sum(not (originals[i] in written and edited[i] in written) for i in range(60))
    print(f"near-duplicate recall {caught / 60:.3f}")
    assert caught / 60 >= 0.95
    assert manifest["dropped"] == {"exact_duplicate": 10, "near_duplicate": caught}
    assert manifest["documents_read"] == 270
    assert len(manifest["shards"]) == 2 and all(s["documents"]["train"] for s in
                                                 manifest["shards"])

    # the control: without near dedup every edited copy survives (so recall measures MinHash)
    control = prepare([str(root)], str(tokenizer_dir), str(tmp_path / "control"),
                      PrepareOptions(**{**QUIET, "near_dedup": False}))
    assert control["dropped"] == {"exact_duplicate": 10}
    assert set(edited) <= set(_written(tmp_path / "control", tokenizer))


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
    # near dedup off: word salad over 100 words is near-duplicate word sets (MinHash drops
    # them before the token filter, which runs on the survivors)
    options = PrepareOptions(filters=FilterOptions(
        min_characters=50, max_characters=5000, max_tokens=600, languages=("en",)),
        **{**QUIET, "near_dedup": False})
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
                       PrepareOptions(**{**QUIET, "near_dedup": False}))
    assert manifest["read_errors"] == {"bad_encoding": 2, "malformed_json": 1,
                                       "missing_field": 1, "unreadable_file": 2}
    examples = " ".join(manifest["read_error_examples"])
    assert "truncated.jsonl.gz" in examples and "broken.parquet" in examples
    assert "mixed.jsonl:2: malformed_json" in examples
    assert set(good) <= set(_written(tmp_path / "out", tokenizer))


def _outputs(directory):
    """{name: bytes} of the shard files and markers of a prepared folder."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())
            if p.name.startswith(("train-", "validation-", "shard-"))}


def test_failed_task_reruns_alone_to_the_same_output(planted, tokenizer_dir, tmp_path,
                                                      monkeypatch):
    root, _, _ = planted
    options = PrepareOptions(**{**QUIET, "validation_fraction": 0.1})
    reference = prepare([str(root)], str(tokenizer_dir), str(tmp_path / "reference"), options)

    out = tmp_path / "out"
    real_run = stages_module.ShardWriter.run
    ranks = []

    def fail_task_1_once(self, data, rank=0, world_size=1):
        ranks.append(rank)
        if rank == 1 and ranks.count(1) == 1:
            next(iter(data))  # mid-task: the task has read, deduplicated, then dies
            raise KeyboardInterrupt
        return real_run(self, data, rank, world_size)

    monkeypatch.setattr(stages_module.ShardWriter, "run", fail_task_1_once)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(root)], str(tokenizer_dir), str(out), options)
    assert not (out / shards.MANIFEST).exists() and (out / "train-00000.array_record").exists()
    (out / "train-00001.array_record").write_bytes(b"half-written debris")
    finished = {p: p.stat().st_mtime_ns for p in (out / "logs").glob("*/completions/*")}
    buckets = minhash.MinhashParams().num_buckets
    assert len(finished) == 2 + 2 + 2 + buckets + 1 + 1  # clean exact signatures buckets ...

    resumed = prepare([str(root)], str(tokenizer_dir), str(out), options)
    assert ranks == [0, 1, 1]  # the rerun ran write task 1 alone; nothing before it
    assert all(p.stat().st_mtime_ns == t for p, t in finished.items())
    assert {k: v for k, v in resumed.items() if k != "inputs"} == \
        {k: v for k, v in reference.items() if k != "inputs"}
    assert _outputs(out) == _outputs(tmp_path / "reference")

    # other settings into the same folder: refused, naming what changed
    with pytest.raises(ConfigError, match="--out.*another prepare run.*options"):
        prepare([str(root)], str(tokenizer_dir), str(out),
                PrepareOptions(**{**options.__dict__, "tasks": 3}))
    assert os.path.isfile(out / shards.MANIFEST)


def test_exact_stage_split_by_hash_range_keeps_the_same_survivors(tokenizer_dir, tokenizer,
                                                                     tmp_path, monkeypatch):
    """The exact stage runs k finder tasks, each on 1/k of the hash range (k = --tasks); the
    shards equal those of one finder task. Five tasks read a file each; every file holds the
    same 40 documents at the same positions (a copy per task with equal priority and index:
    only ExactSignature's rank priority decides which survives) among its own documents."""
    rng = random.Random(7)
    shared = [distinct_document(rng, 60) for _ in range(40)]
    for rank in range(5):
        own = [distinct_document(rng, 60) for _ in range(40)]
        _jsonl(tmp_path / f"part_{rank}.jsonl",
               [text for pair in zip(shared, own, strict=True) for text in pair] + own[:5])  # + copies
    options = PrepareOptions(tasks=5, near_dedup=False, launch=LaunchOptions(workers=1))
    derived, outputs, manifests = stages_module.exact_finder_tasks, {}, {}
    for finders in (1, 2, 5):
        monkeypatch.setattr(stages_module, "exact_finder_tasks", lambda tasks, k=finders: k)
        out = tmp_path / f"out_{finders}"
        manifests[finders] = prepare([str(tmp_path / "part_*.jsonl")], str(tokenizer_dir),
                                     str(out), options)
        outputs[finders] = _outputs(out)
        completions = out / "logs" / "exact" / "completions"
        assert len(list(completions.iterdir())) == finders
    assert manifests[1]["dropped"]["exact_duplicate"] == 4 * 40 + 5 * 5
    written = _written(tmp_path / "out_1", tokenizer)
    assert len(written) == len(set(written)) == 40 + 5 * 40
    assert outputs[2] == outputs[1] and outputs[5] == outputs[1]
    assert manifests[2] == manifests[1] == manifests[5]
    assert derived(5) == 5  # prepare's own choice: one finder task per --tasks


def test_decontamination_drops_documents_sharing_a_13_gram(tokenizer_dir, tokenizer, tmp_path):
    rng = random.Random(6)
    evaluation = [distinct_document(rng, 60) for _ in range(3)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                 for t in evaluation))
    words = evaluation[1].split()
    train = [distinct_document(rng, 80) for _ in range(20)]
    leaked = [train[0] + " " + " ".join(words[10:23]),  # 13 evaluation words in a row
              " ".join(words[30:43]).upper() + ", " + train[1]]  # case and punctuation differ
    near_miss = [train[2] + " " + " ".join(words[10:22])]  # 12 words only: kept
    _jsonl(tmp_path / "train.jsonl", train[3:] + leaked + near_miss)
    manifest = prepare([str(tmp_path / "train.jsonl")], str(tokenizer_dir),
                       str(tmp_path / "out"),
                       PrepareOptions(decontaminate=(str(tmp_path / "eval.jsonl"),),
                                      **{**QUIET, "near_dedup": False}))
    assert manifest["dropped"] == {"contaminated": 2}
    assert sorted(_written(tmp_path / "out", tokenizer)) == sorted(train[3:] + near_miss)


def test_slurm_dry_run_writes_the_job_arrays(planted, tokenizer_dir, tmp_path):
    root, _, _ = planted
    out = tmp_path / "out"
    launch = LaunchOptions(executor="slurm", partition="cpu", time="2:00:00", dry_run=True)
    assert prepare([str(root)], str(tokenizer_dir), str(out),
                   PrepareOptions(tasks=3, launch=launch)) is None
    scripts = sorted((out / "slurm").glob("*.sbatch"))
    jobs = [p.name.split("-", 1)[1].removesuffix(".sbatch") for p in scripts]
    stages = ["clean", "exact", "signatures", "buckets", "cluster", "write", "manifest"]
    assert jobs == [part for s in stages for part in (f"maxmoe-{s}", f"maxmoe-{s}-stats")]
    arrays = {"clean": 3, "exact": 3, "signatures": 3, "buckets": minhash.MinhashParams().num_buckets,
              "cluster": 1, "write": 3, "manifest": 1}
    for path, job in zip(scripts[::2], stages, strict=True):
        text = path.read_text()
        assert f"#SBATCH --array=0-{arrays[job] - 1}" in text
        assert "#SBATCH --partition=cpu" in text and "#SBATCH --time=2:00:00" in text
        assert "launch_pickled_pipeline" in text and str(out / "logs" / job) in text
        assert (out / "logs" / job / "executor.pik").is_file()
    submit = (out / "slurm" / "submit.sh").read_text().splitlines()[3:]
    # stage k waits for stage k-1 to succeed, each stats job for its own stage; sbatch reads
    # the job ids from the shell variables set by the lines before
    for number, line in enumerate(submit, start=1):
        assert line.startswith(f"JOB_{number:02d}=$(sbatch --parsable ")
        waits_for = number - 2 if number % 2 else number - 1
        assert (f"--dependency=afterok:${{JOB_{waits_for:02d}}} " in line) == (number > 1)
    assert all("${JOB" not in p.read_text() for p in scripts)
    assert not (out / shards.MANIFEST).exists()


def test_input_listing_errors(tmp_path, tokenizer_dir, monkeypatch):
    with pytest.raises(ConfigError, match="matches no files"):
        prepare([str(tmp_path / "none" / "*.jsonl")], str(tokenizer_dir), str(tmp_path / "o"))
    (tmp_path / "a.txt").write_text("hello")
    with pytest.raises(ConfigError, match="--tokenizer"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path), str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="--tasks"):
        prepare([str(tmp_path / "a.txt")], str(tokenizer_dir), str(tmp_path / "o"),
                PrepareOptions(tasks=0))
    monkeypatch.setitem(sys.modules, "ray", None)  # ray not installed
    with pytest.raises(ConfigError, match=r"needs the package 'ray'.*maxmoe\[ray\]"):
        prepare([str(tmp_path / "a.txt")], str(tokenizer_dir), str(tmp_path / "o"),
                PrepareOptions(launch=LaunchOptions(executor="ray")))
    assert not (tmp_path / "o").exists()
    assert InputOptions().json_field == "text"


class KillTask(stages_module.PipelineStep):
    """Passes documents on; with MAXMOE_TEST_KILL_TASK=RANK set, task RANK's process kills
    itself (SIGKILL: no exception, no cleanup, as the out-of-memory killer) at its 5th one."""

    name = "test kill -9"

    def run(self, data, rank=0, world_size=1):
        for count, doc in enumerate(data):
            if os.environ.get("MAXMOE_TEST_KILL_TASK") == str(rank) and count == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            yield doc


def test_task_process_killed_outright_ends_the_run_and_reruns(planted, tokenizer_dir, tmp_path,
                                                              monkeypatch):
    """Two workers (task processes of TaskProcesses): a kill -9 of write task 1 ends the command
    with an error naming the task, instead of datatrove's pool waiting forever; a rerun
    completes it to the shards of a run without a kill."""
    root, _, _ = planted
    options = PrepareOptions(tasks=2, near_dedup=False, launch=LaunchOptions(workers=2))
    real_build = stages_module.build_stages

    def with_kill(files, out, opts):
        stages = real_build(files, out, opts)
        write = next(s for s in stages if s.name == "write")
        write.pipeline.insert(-1, KillTask())  # before the shard writer
        return stages

    monkeypatch.setattr(stages_module, "build_stages", with_kill)
    reference = prepare([str(root)], str(tokenizer_dir), str(tmp_path / "reference"), options)
    monkeypatch.setenv("MAXMOE_TEST_KILL_TASK", "1")
    # task 0 is listed too when it still ran: the pool stops the other processes with it
    with pytest.raises(RuntimeError, match=r"stage write: tasks \[(0, )?1\] failed or their "
                                           r"process was killed"):
        prepare([str(root)], str(tokenizer_dir), str(tmp_path / "out"), options)
    monkeypatch.delenv("MAXMOE_TEST_KILL_TASK")
    resumed = prepare([str(root)], str(tokenizer_dir), str(tmp_path / "out"), options)
    assert _outputs(tmp_path / "out") == _outputs(tmp_path / "reference")
    assert resumed["dropped"] == reference["dropped"]
