"""The stages of `maxmoe data prepare` as datatrove pipelines, and the manifest they end in.

    clean      N tasks   read files[rank::N] -> normalise -> character, language and
                         decontamination filters -> OUT/work/clean/{rank}.jsonl.gz
                         + exact-dedup hashes
    exact      N tasks   datatrove ExactFindDedups: duplicates of the hashes, globally; task k
                         takes the k-th of N equal hash ranges (finder_workers = N)
    signatures N tasks   clean docs minus exact duplicates -> MinHash signatures (per bucket)
    buckets    B tasks   datatrove MinhashDedupBuckets: duplicate pairs, one task a bucket
    cluster    1 task    datatrove MinhashDedupCluster: pairs -> clusters, one survivor each
    write      N tasks   clean docs minus exact and near duplicates -> tokenize, token filter,
                         train/validation split -> OUT/{split}-{rank}.array_record + marker
    manifest   1 task    counts of every stage and shard -> OUT/manifest.json; deletes work/

A stage is one datatrove executor run; its completions (OUT/logs/STAGE/completions) make a
rerun skip finished tasks, and every task writes its outputs under fixed names, so a failed
or killed task reruns alone to the same files. Task `rank` of every N-task stage handles the
documents of the same input files, so output depends on the inputs and N only.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import shutil
from pathlib import Path

from datatrove.data import Document, DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.dedup import (
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
    MinhashDedupSignature,
)
from datatrove.pipeline.dedup.exact_dedup import (
    ExactDedupConfig,
    ExactDedupFilter,
    ExactDedupSignature,
    ExactFindDedups,
)
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter

from maxmoe.data import minhash, shards
from maxmoe.data.steps import (
    CharacterFilter,
    Decontaminate,
    InputReader,
    LanguageFilter,
    Normalize,
    ShardWriter,
)


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    pipeline: list
    tasks: int


def _text(doc: Document) -> bytes:
    return doc.text.encode("utf-8", "surrogatepass")


class ExactSignature(ExactDedupSignature):
    """datatrove's exact-dedup hashes, with priority 65535 - rank: among identical documents
    the one in the lowest task survives (then the first in that task). The finder's order
    (hash, -priority, index in task) is then total, so which copy survives does not depend on
    how its heaps happen to break ties, nor on the number of finder tasks."""

    def run(self, data: DocumentsPipeline, rank: int = 0, world_size: int = 1):
        self.priority = MAX_TASKS + 1 - rank
        return super().run(data, rank, world_size)

    def get_hashes(self, doc: Document, doc_idx: int) -> list[tuple[int, int, int]]:
        return [(self.hash_fc(self.config.content_getter(doc)), self.priority, doc_idx)]


# the exact-dedup priority is a 16-bit number >= 1 that encodes the task (ExactSignature)
MAX_TASKS = 65534


def exact_finder_tasks(tasks: int) -> int:
    """Tasks of the exact stage for `tasks` clean tasks: as many, each finding the duplicates
    in 1/tasks of the hash range (so it scales with the cluster, like the other stages). The
    survivors do not depend on it (ExactSignature); tests/data/test_prepare.py checks."""
    return tasks


def signature_step(output_folder: str) -> PipelineStep:
    """datatrove's MinHash signature stage with maxmoe's parameters and offline words."""
    return MinhashDedupSignature(output_folder, minhash.minhash_config(),
                                 language=minhash.word_tokenizer())


class RankReader(JsonlReader):
    """Reads work/clean/{rank}.jsonl.gz only: task `rank` of a later stage sees exactly the
    documents task `rank` of `clean` kept, in the same order (the dedup steps index by it),
    even when an earlier task kept nothing and wrote no file."""

    name = "maxmoe clean documents"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1):
        name = f"{rank:05d}.jsonl.gz"
        if self.data_folder.isfile(name):
            yield from self.read_files_shard([name])


def build_stages(files: list[str], out: Path, options) -> list[Stage]:
    """The stages of one prepare run (prepare.PrepareOptions `options`) into `out`."""
    work, tasks = out / "work", options.tasks
    exact = ExactDedupConfig(content_getter=_text)
    clean = [InputReader(files, options.inputs, str(out / "logs" / "read_errors")),
             Normalize(options.filters), CharacterFilter(options.filters)]
    if options.filters.languages:
        clean.append(LanguageFilter(options.filters))
    if options.decontaminate:
        clean.append(Decontaminate(list(options.decontaminate), options.inputs))
    clean.append(JsonlWriter(str(work / "clean"), output_filename="${rank}.jsonl.gz",
                             adapter=_document_dict))
    finders = exact_finder_tasks(tasks)
    if options.exact_dedup:
        clean.append(ExactSignature(str(work / "exact_sigs"), exact, finder_workers=finders))
    stages = [Stage("clean", clean, tasks)]
    if options.exact_dedup:
        stages.append(Stage("exact", [ExactFindDedups(str(work / "exact_sigs"),
                                                      str(work / "exact_dups"), exact)],
                            finders))

    def survivors() -> list:  # the clean documents that the dedup stages keep, so far
        steps = [RankReader(str(work / "clean"))]
        if options.exact_dedup:
            steps.append(ExactDedupFilter(str(work / "exact_dups"), exact))
        return steps

    write = survivors()
    if options.near_dedup:
        config = minhash.minhash_config()
        stages += [
            Stage("signatures", survivors() + [signature_step(str(work / "minhash_sigs"))],
                  tasks),
            Stage("buckets", [MinhashDedupBuckets(str(work / "minhash_sigs"),
                                                  str(work / "minhash_buckets"), config=config)],
                  config.num_buckets),
            Stage("cluster", [MinhashDedupCluster(str(work / "minhash_buckets"),
                                                  str(work / "minhash_clusters"), config=config)],
                  1)]
        write.append(MinhashDedupFilter(str(work / "minhash_clusters")))
    write.append(ShardWriter(str(out), options.filters, options.validation_fraction,
                             options.seed))
    stages.append(Stage("write", write, tasks))
    stages.append(Stage("manifest", [ManifestWriter(str(out))], 1))
    return stages


def _document_dict(writer, document: Document) -> dict:
    return {"id": document.id, "text": document.text}


# Which datatrove steps drop documents for which manifest reason (the others name their own
# reason as `dropped_<reason>`).
_DEDUP_REASONS = {ExactDedupFilter.name: "exact_duplicate",
                  MinhashDedupFilter.name: "near_duplicate"}


class ManifestWriter(PipelineStep):
    """The last stage: sums the stats of the clean and write tasks and the shard markers into
    OUT/manifest.json (its presence marks the dataset complete), then deletes OUT/work."""

    type = "💽 - WRITER"
    name = "maxmoe manifest"

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1):
        directory = Path(self.out)
        settings = json.loads((directory / shards.SETTINGS).read_text())
        counts = collections.Counter()
        for stage in ("clean", "write"):  # signatures repeats the exact filter: not counted
            for path in sorted((directory / "logs" / stage / "stats").glob("*.json")):
                for step in json.loads(path.read_text()):
                    _count_step(step, counts)
        examples: list[str] = []
        for path in sorted((directory / "logs" / "read_errors").glob("*.json")):
            examples.extend(json.loads(path.read_text())["examples"])
        markers = [json.loads(shards.marker_path(directory, rank).read_text())
                   for rank in range(settings["options"]["tasks"])]
        shards.write_json(directory / shards.MANIFEST,
                          _manifest(settings, counts, examples[:20], markers))
        shutil.rmtree(directory / "work", ignore_errors=True)
        return ()


def _count_step(step: dict, counts: collections.Counter) -> None:
    """Adds one step's datatrove stats of one task to `counts` (key -> number)."""
    for key, value in step["stats"].items():
        number = value["total"] if isinstance(value, dict) else value
        reason = _DEDUP_REASONS.get(step["name"].split(": ", 1)[-1])  # "type: name"
        if reason and key == "dropped":
            counts[f"dropped_{reason}"] += number
        elif key.startswith(("dropped_", "read_error_")) or key == "documents_read":
            counts[key] += number


def _manifest(settings: dict, counts: collections.Counter, examples: list[str],
              markers: list[dict]) -> dict:
    totals = {key: collections.Counter() for key in ("documents", "tokens")}
    for marker in markers:
        for key, counter in totals.items():
            counter.update(marker[key])
    tokenizer = settings["tokenizer"]

    def prefixed(prefix: str) -> dict:
        return dict(sorted((k[len(prefix):], int(v)) for k, v in counts.items()
                           if k.startswith(prefix) and v))

    return {
        "format": 1,
        "inputs": settings["inputs"],
        "input_files": len(settings["files"]),
        "settings": settings["options"],
        "tokenizer": tokenizer,
        "token_dtype": shards.token_dtype(tokenizer["vocab_size"]).name,
        "documents_read": int(counts["documents_read"]),
        "documents_written": {s: totals["documents"][s] for s in shards.SPLITS},
        "tokens_written": {s: totals["tokens"][s] for s in shards.SPLITS},
        "dropped": prefixed("dropped_"),
        "read_errors": prefixed("read_error_"),
        "read_error_examples": examples,
        "shards": [{"index": m["index"], "files": m["files"], "documents": m["documents"],
                    "tokens": m["tokens"]} for m in markers],
    }
