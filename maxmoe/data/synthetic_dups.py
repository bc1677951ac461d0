"""A corpus with planted near-duplicates and hard negatives, and the dedup quality it gives.

`generate` writes JSON-lines shards (`{"id", "text"}`) deterministically from a seed, and returns
the ground truth: every (original, copy) near-duplicate pair and every hard-negative pair with its
true Jaccard similarity on the shingles `maxmoe.data.minhash` uses (datatrove's normalisation and
tokenizer, so "true" means what the MinHash estimates).

- Near-duplicates edit 1-5% of an original's words (substitute, insert, delete), reorder its
  paragraphs (plus up to 1% edits) or vary its boilerplate (header/footer words changed, at most
  5% of the document's words in all). Each original has one to three copies.
- Hard negatives are pairs of different documents under the same site's header and footer, with
  the boilerplate's length searched so the pair's Jaccard lands on a target drawn from 0.3-0.7.
- Unrelated documents fill the rest. Words follow a Zipf law over a pseudo-word vocabulary, so
  unrelated documents share their common words as real text does.

`score` turns the MinHash stages' cluster ids into recall per true-Jaccard bin and false-positive
rates, the figures issue 42 asks for (docs/performance/data.md, "Measured quality").
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import json
import os
import random

from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup import (
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
    MinhashDedupSignature,
)
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.text import ngrams, simplify_text

from maxmoe.data.minhash import MinhashParams, minhash_config, word_tokenizer

_SYLLABLES = ("ka to ri ne mu sa lo vi pe da ru mi ko te na bu li so ga fe zo ha yu we "
              "qi tre bla cor dan ist ven por lum ber sto gra nel").split()
EDIT_RANGE = (0.01, 0.05)  # fraction of words a near-duplicate edits
HARD_NEGATIVE_RANGE = (0.3, 0.7)  # target Jaccard of hard-negative pairs
JACCARD_BINS = (0.0, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 1.0001)


@dataclasses.dataclass(frozen=True)
class CorpusSpec:
    documents: int = 2000  # approximate total number of documents
    near_dup_fraction: float = 0.3  # share of documents that are copies of an original
    hard_negative_fraction: float = 0.3  # share of documents in hard-negative pairs
    files: int = 4  # JSON-lines shards (datatrove tasks read whole files)
    seed: int = 0


@dataclasses.dataclass
class GroundTruth:
    near_dups: list[tuple[str, str, float, str]]  # (original id, copy id, Jaccard, kind)
    hard_negatives: list[tuple[str, str, float]]  # (id, id, Jaccard)
    unrelated: list[str]  # ids of documents with no planted relative


class _Words:
    """Zipf-distributed pseudo-words: rank k has weight 1/k."""

    def __init__(self, rng: random.Random, size: int = 30000):
        words = set()
        while len(words) < size:
            words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
        self.vocab = sorted(words)
        rng.shuffle(self.vocab)
        self.cum = list(itertools.accumulate(1.0 / (k + 1) for k in range(size)))

    def sample(self, rng: random.Random, count: int) -> list[str]:
        return rng.choices(self.vocab, cum_weights=self.cum, k=count)

    def rare(self, rng: random.Random, count: int) -> list[str]:
        """Words from the vocabulary's rare half (site names, menus, legal text)."""
        return rng.choices(self.vocab[len(self.vocab) // 2:], k=count)


def _body(words: _Words, rng: random.Random) -> list[list[str]]:
    """3-6 paragraphs of 40-120 words each."""
    return [words.sample(rng, rng.randint(40, 120)) for _ in range(rng.randint(3, 6))]


def _render(header: list[str], paragraphs: list[list[str]], footer: list[str]) -> str:
    def para(ws):
        sentences = [ws[i:i + 12] for i in range(0, len(ws), 12)]
        return " ".join(" ".join(s).capitalize() + "." for s in sentences if s)
    blocks = ([" | ".join(header)] if header else []) + [para(p) for p in paragraphs]
    return "\n\n".join(blocks + ([" ".join(footer)] if footer else []))


def _edit(words: _Words, rng: random.Random, paragraphs: list[list[str]],
          fraction: float) -> list[list[str]]:
    """Substitute, insert or delete `fraction` of all words, at random positions."""
    out = [list(p) for p in paragraphs]
    total = sum(len(p) for p in out)
    for _ in range(max(1, round(fraction * total))):
        para = rng.choice([p for p in out if len(p) > 1])
        i, op = rng.randrange(len(para)), rng.random()
        if op < 0.5:
            para[i] = words.sample(rng, 1)[0]
        elif op < 0.75:
            para.insert(i, words.sample(rng, 1)[0])
        else:
            del para[i]
    return out


class _Shingler:
    """The shingle set `maxmoe.data.minhash` hashes: datatrove's normalisation, then n-grams."""

    def __init__(self, params: MinhashParams):
        self.config, self.tokenizer = minhash_config(params), word_tokenizer()

    def __call__(self, text: str) -> set[tuple[str, ...]]:
        tokens = self.tokenizer.word_tokenize(simplify_text(text, self.config.norm_config))
        return set(ngrams(tokens, self.config.n_grams))


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def _copy(words, rng, header, body, footer):
    """One near-duplicate of (header, body, footer): (text, kind)."""
    kind = rng.choice(("edit", "reorder", "boilerplate"))
    if kind == "edit":
        return _render(header, _edit(words, rng, body, rng.uniform(*EDIT_RANGE)), footer), kind
    if kind == "reorder":
        order = list(range(len(body)))
        while order == sorted(order):
            rng.shuffle(order)
        edited = _edit(words, rng, body, rng.uniform(0.0, 0.01))
        return _render(header, [edited[i] for i in order], footer), kind
    budget = max(1, int(0.05 * sum(map(len, body + [header, footer]))))
    header, footer = list(header), list(footer)
    for _ in range(rng.randint(1, budget)):
        part = header if rng.random() < 0.5 else footer
        part[rng.randrange(len(part))] = words.rare(rng, 1)[0]
    return _render(header, body, footer), kind


def _boilerplate(words, rng, shingle, body_a, body_b, target):
    """Header and footer whose length puts the two documents' Jaccard nearest `target`.

    The search shingles the word lists directly (pseudo-words are lower-case letters, so
    datatrove's normalisation leaves them as they are); the result is measured on the text.
    """
    n = shingle.config.n_grams
    pool = words.rare(rng, 3 * sum(map(len, body_a + body_b)))  # enough for Jaccard 0.7

    def sets(size):
        header, footer = pool[:size // 3], pool[size // 3:size]
        return [set(ngrams(header + [w for p in body for w in p] + footer, n))
                for body in (body_a, body_b)], header, footer
    lo, hi, best = 4, len(pool), None
    while lo <= hi:
        size = (lo + hi) // 2
        (a, b), header, footer = sets(size)
        j = jaccard(a, b)
        if best is None or abs(j - target) < abs(best[2] - target):
            best = (header, footer, j)
        lo, hi = (size + 1, hi) if j < target else (lo, size - 1)
    header, footer, _ = best
    return header, footer, jaccard(shingle(_render(header, body_a, footer)),
                                   shingle(_render(header, body_b, footer)))


def _site(words, rng):
    """A site's header and footer for near-dup originals and unrelated documents (6-40 words)."""
    size = rng.randint(6, 40)
    return words.rare(rng, size // 3), words.rare(rng, size - size // 3)


def generate(spec: CorpusSpec, out_dir: str, params: MinhashParams | None = None) -> GroundTruth:
    """Write `spec.files` JSON-lines shards of shuffled documents under `out_dir`.

    Returns the ground truth, with Jaccard on `params`' shingles (default MinhashParams()).
    The same spec and params give byte-identical files.
    """
    rng = random.Random(spec.seed)
    words, shingle = _Words(rng), _Shingler(params or MinhashParams())
    docs: list[tuple[str, str]] = []
    truth = GroundTruth([], [], [])
    n_copies = int(spec.documents * spec.near_dup_fraction)
    n_negative_pairs = int(spec.documents * spec.hard_negative_fraction) // 2
    while sum(1 for d in docs if d[0].startswith("c")) < n_copies:
        header, footer = _site(words, rng)
        body = _body(words, rng)
        original = (f"o{len(docs)}", _render(header, body, footer))
        docs.append(original)
        for _ in range(rng.randint(1, 3)):
            text, kind = _copy(words, rng, header, body, footer)
            docs.append((f"c{len(docs)}", text))
            truth.near_dups.append((original[0], docs[-1][0],
                                    jaccard(shingle(original[1]), shingle(text)), kind))
    for _ in range(n_negative_pairs):
        j = -1.0
        while not HARD_NEGATIVE_RANGE[0] <= j < HARD_NEGATIVE_RANGE[1]:  # the search can overshoot
            body_a, body_b = _body(words, rng), _body(words, rng)
            target = rng.uniform(*HARD_NEGATIVE_RANGE)
            header, footer, j = _boilerplate(words, rng, shingle, body_a, body_b, target)
        docs.append((f"h{len(docs)}", _render(header, body_a, footer)))
        docs.append((f"h{len(docs)}", _render(header, body_b, footer)))
        truth.hard_negatives.append((docs[-2][0], docs[-1][0], j))
    while len(docs) < spec.documents:
        header, footer = _site(words, rng)
        docs.append((f"u{len(docs)}", _render(header, _body(words, rng), footer)))
        truth.unrelated.append(docs[-1][0])
    rng.shuffle(docs)
    write_shards(docs, out_dir, spec.files)
    return truth


def write_shards(docs: list[tuple[str, str]], out_dir: str, files: int) -> None:
    """`docs` round-robin into `files` JSON-lines files named 00000.jsonl, 00001.jsonl, ..."""
    os.makedirs(out_dir, exist_ok=True)
    for f in range(files):
        with open(os.path.join(out_dir, f"{f:05d}.jsonl"), "w") as out:
            for doc_id, text in docs[f::files]:
                out.write(json.dumps({"id": doc_id, "text": text}) + "\n")


def _bin(j: float) -> str:
    i = bisect.bisect_right(JACCARD_BINS, j) - 1
    hi = min(JACCARD_BINS[i + 1], 1.0)
    return f"[{JACCARD_BINS[i]:.3g}, {hi:.3g}{']' if hi == 1.0 else ')'}"


def score(truth: GroundTruth, cluster_of: dict[str, int], survivors: set[str]) -> dict:
    """Recall and false positives from the MinHash clustering.

    `cluster_of` maps a document id to its cluster (datatrove's minhash_cluster_id, -1 when the
    document matched nothing); `survivors` are the ids the filter kept. A near-duplicate pair is
    recalled when both documents share a cluster; a hard-negative pair is a false positive when
    they do; an unrelated document is a false positive when it does not survive.
    """
    def joined(a, b):
        return cluster_of.get(a, -1) != -1 and cluster_of.get(a) == cluster_of.get(b)
    bins: dict[str, list[int]] = {}
    kinds: dict[str, list[int]] = {}
    for a, b, j, kind in truth.near_dups:
        for hit in (bins.setdefault(_bin(j), [0, 0]), kinds.setdefault(kind, [0, 0])):
            hit[0] += joined(a, b)
            hit[1] += 1
    negative_bins: dict[str, list[int]] = {}
    for a, b, j in truth.hard_negatives:
        hit = negative_bins.setdefault(_bin(j), [0, 0])
        hit[0] += joined(a, b)
        hit[1] += 1
    recalled = sum(h for h, _ in bins.values())
    false_pos = sum(h for h, _ in negative_bins.values())
    return {
        "recall": recalled / max(1, len(truth.near_dups)),
        "recall_by_bin": dict(sorted(bins.items())),
        "recall_by_kind": dict(sorted(kinds.items())),
        "hard_negative_fp": false_pos / max(1, len(truth.hard_negatives)),
        "hard_negative_fp_by_bin": dict(sorted(negative_bins.items())),
        "unrelated_removed": sum(u not in survivors for u in truth.unrelated),
        "near_dup_pairs": len(truth.near_dups),
        "hard_negative_pairs": len(truth.hard_negatives),
        "survivors": len(survivors),
    }


def run_local(input_dir: str, work_dir: str, params: MinhashParams | None = None,
              tasks: int = 4, workers: int = 1) -> tuple[dict[str, int], set[str]]:
    """Datatrove's four MinHash stages on `input_dir`'s JSON lines, by its LocalPipelineExecutor.

    Returns (document id -> cluster id, -1 when unmatched; ids the filter kept). Stage folders
    go under `work_dir`. `tasks` reads that many files in the signature and filter stages; the
    bucket stage runs one task per bucket and the cluster stage one task, as datatrove requires.
    """
    config = minhash_config(params)
    path = functools.partial(os.path.join, work_dir)
    stages = [
        ([JsonlReader(input_dir), MinhashDedupSignature(path("sigs"), config=config,
                                                        language=word_tokenizer())], tasks),
        ([MinhashDedupBuckets(path("sigs"), path("buckets"), config=config)], config.num_buckets),
        ([MinhashDedupCluster(path("buckets"), path("remove"), config=config,
                              save_cluster_id=True)], 1),
        ([JsonlReader(input_dir),
          MinhashDedupFilter(path("remove"), load_cluster_ids=True,
                             exclusion_writer=_writer(path("removed"))),
          _writer(path("kept"))], tasks),
    ]
    for i, (pipeline, n) in enumerate(stages):
        LocalPipelineExecutor(pipeline, tasks=n, workers=min(workers, n),
                              logging_dir=path(f"logs/stage{i + 1}")).run()
    cluster_of, survivors = {}, set()
    for folder in ("kept", "removed"):
        for doc in read_jsonl(path(folder)):
            cluster_of[doc["id"]] = doc["metadata"].get("minhash_cluster_id", -1)
            if folder == "kept":
                survivors.add(doc["id"])
    return cluster_of, survivors


def _writer(folder: str):
    return JsonlWriter(folder, output_filename="${rank}.jsonl", compression=None)


def read_jsonl(folder: str):
    """Every JSON line of every *.jsonl file under `folder` (none when it does not exist)."""
    for root, _, names in sorted(os.walk(folder)):
        for name in sorted(n for n in names if n.endswith(".jsonl")):
            with open(os.path.join(root, name)) as f:
                yield from (json.loads(line) for line in f)
