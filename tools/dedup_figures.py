"""Figures of docs/pending/dedupq.md: MinHash parameter scan, dedup quality, per-stage scale.

  python3 tools/dedup_figures.py scan
      the Jaccard of a copy with a fraction p of its words edited, per n-gram size, and for
      each hash budget the bucket x row split with the best recall at <= 0.5% mean false
      positives over Jaccard 0.3-0.7 (P(s) = 1 - (1 - s**r)**b)
  python3 tools/dedup_figures.py quality --documents 20000 [--params fineweb]
      a generated corpus through datatrove's four MinHash stages (LocalPipelineExecutor):
      recall per true-Jaccard bin, false positives among hard negatives
  python3 tools/dedup_figures.py scale --sizes 10000 30000 100000
      CPU seconds of each stage (one worker, so one core) -> documents per second per core, and
      the peak RSS of the clustering stage, run alone in a fresh process, at each size

  python3 tools/dedup_figures.py prepare --documents 4000
      the same corpus through `maxmoe data prepare --executor local` and `--executor ray`, 2
      tasks each: shards compared byte for byte, near-duplicate drops against the direct run

  python3 tools/dedup_figures.py prepare-scale --sizes 10000 30000
      CPU seconds of each stage of `maxmoe data prepare` (local executor, one worker, 2 tasks)
      -> documents per second per core, tokenization and filters included

  python3 tools/dedup_figures.py exact-split --clean-tasks 64 --documents 2000000 --finders 1 4
      the exact stage alone on random 64-bit hashes (30% of them copies) from C clean tasks:
      CPU seconds of each of k finder tasks (ExactFindDedups on 1/k of the hash range)

Run with `nice`: the figures are CPU time, so a shared machine slows them less than wall time.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from maxmoe.data import synthetic_dups as sd
from maxmoe.data.minhash import MinhashParams, minhash_config, word_tokenizer

FINEWEB = MinhashParams(ngram=5, num_buckets=14, hashes_per_bucket=8, precision=64)


def scan(_args) -> None:
    edits = (0.01, 0.03, 0.05)
    print("| n-gram | " + " | ".join(f"Jaccard at {p:.0%} edits" for p in edits) + " |")
    print("|---|" + "---|" * len(edits))
    for n in (1, 2, 3, 5):
        q = [(1 - p) ** n for p in edits]
        print(f"| {n} | " + " | ".join(f"{x / (2 - x):.3f}" for x in q) + " |")
    negatives = np.linspace(0.3, 0.7, 2001)
    print("\n| hashes <= | b x r | mean FP over J 0.3-0.7 | P(0.7) | P(0.82) | P(0.90) | P(0.95) |")
    print("|---|---|---|---|---|---|---|")
    for budget in (112, 256, 384, 512):
        best = None
        for r in range(2, 40):
            for b in range(1, budget // r + 1):
                p = MinhashParams(num_buckets=b, hashes_per_bucket=r).detection_probability
                fp = float(np.mean(p(negatives)))
                if fp <= 0.005 and (best is None or p(0.9) > best[1](0.9)):
                    best = (f"{b} x {r}", p, fp)
        name, p, fp = best
        print(f"| {budget} | {name} | {fp:.2%} | {p(0.7):.3f} | {p(0.82):.3f} | {p(0.9):.3f} "
              f"| {p(0.95):.4f} |")
    p = FINEWEB.detection_probability
    print(f"| FineWeb | 14 x 8 | {float(np.mean(p(negatives))):.2%} | {p(0.7):.3f} | "
          f"{p(0.82):.3f} | {p(0.9):.3f} | {p(0.95):.4f} |")


def quality(args) -> None:
    params = FINEWEB if args.params == "fineweb" else MinhashParams()
    spec = sd.CorpusSpec(documents=args.documents, files=args.tasks, seed=args.seed)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        truth = sd.generate(spec, os.path.join(tmp, "in"), params)
        clusters, kept = sd.run_local(os.path.join(tmp, "in"), os.path.join(tmp, "work"), params,
                                      tasks=args.tasks)
        result = sd.score(truth, clusters, kept)
    print(f"params {params}: threshold (1/b)^(1/r) = {params.threshold:.3f}")
    print("\n| true Jaccard | near-dup pairs | recalled | recall | P(s) at bin middle |")
    print("|---|---|---|---|---|")
    for name, (hit, total) in result["recall_by_bin"].items():
        lo, hi = (float(x) for x in name.strip("[)]").split(","))
        print(f"| {name} | {total} | {hit} | {hit / total:.3f} | "
              f"{params.detection_probability((lo + hi) / 2):.3f} |")
    print("\n| kind of copy | pairs | recall | lowest true Jaccard |")
    print("|---|---|---|---|")
    for kind, (hit, total) in result["recall_by_kind"].items():
        low = min(j for _, _, j, k in truth.near_dups if k == kind)
        print(f"| {kind} | {total} | {hit / total:.4f} | {low:.3f} |")
    print("\n| true Jaccard | hard-negative pairs | merged | FP rate |")
    print("|---|---|---|---|")
    for name, (hit, total) in result["hard_negative_fp_by_bin"].items():
        print(f"| {name} | {total} | {hit} | {hit / total:.3%} |")
    print(f"\nrecall {result['recall']:.4f} over {result['near_dup_pairs']} pairs; "
          f"hard-negative FP {result['hard_negative_fp']:.4%} over "
          f"{result['hard_negative_pairs']} pairs; unrelated removed "
          f"{result['unrelated_removed']} of {len(truth.unrelated)}")


_CLUSTER = """
import json, sys, time
from datatrove.pipeline.dedup import MinhashDedupCluster
from maxmoe.data.minhash import minhash_config

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to now: importing peaks above the steady state
base = status("VmRSS:")
step = MinhashDedupCluster(sys.argv[1], sys.argv[2], config=minhash_config())
cpu = time.process_time()
step.run()
print(json.dumps({"cpu_s": time.process_time() - cpu, "base_kb": base,
                  "peak_kb": status("VmHWM:")}))
"""


def _stage_cpu(pipeline, tasks: int, logs: str) -> float:
    """CPU seconds of one stage run in this process (workers=1 runs tasks in-process)."""
    from datatrove.executor import LocalPipelineExecutor

    cpu = time.process_time()
    LocalPipelineExecutor(pipeline, tasks=tasks, workers=1, logging_dir=logs).run()
    return time.process_time() - cpu


def _scale_one(size: int, tmp: str, tasks: int) -> dict:
    """CPU seconds of each MinHash stage, dup-pair lines and the cluster stage's peak RSS."""
    from datatrove.pipeline.dedup import (
        MinhashDedupBuckets,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader

    config, path = minhash_config(), lambda *p: os.path.join(tmp, *p)
    spec = sd.CorpusSpec(documents=size, hard_negative_fraction=0.02, files=tasks, seed=size)
    gen = time.process_time()
    sd.generate(spec, path("in"))
    row = {"documents": size, "generate_cpu_s": time.process_time() - gen,
           "bytes": sum(os.path.getsize(path("in", f)) for f in os.listdir(path("in")))}
    row["read_cpu_s"] = _stage_cpu([JsonlReader(path("in"))], tasks, path("logs", "read"))
    row["signature_cpu_s"] = _stage_cpu(
        [JsonlReader(path("in")),
         MinhashDedupSignature(path("sigs"), config=config, language=word_tokenizer())],
        tasks, path("logs", "sig"))
    row["buckets_cpu_s"] = _stage_cpu([MinhashDedupBuckets(path("sigs"), path("buckets"),
                                                           config=config)],
                                      config.num_buckets, path("logs", "buckets"))
    pairs = np.concatenate([np.fromfile(path("buckets", f), np.uint32).reshape(-1, 4)
                            for f in sorted(os.listdir(path("buckets")))])
    # lines the cluster stage reads, and the documents its union-find holds (any in a pair)
    row["dup_lines"] = len(pairs)
    row["cluster_nodes"] = len(np.unique(np.concatenate([pairs[:, :2], pairs[:, 2:]]), axis=0))
    out = subprocess.run([sys.executable, "-c", _CLUSTER, path("buckets"), path("remove")],
                         check=True, capture_output=True, text=True).stdout
    cluster = json.loads(out.strip().splitlines()[-1])
    row.update(cluster_cpu_s=cluster["cpu_s"], cluster_peak_mb=cluster["peak_kb"] / 1024,
               cluster_base_mb=cluster["base_kb"] / 1024)
    row["filter_cpu_s"] = _stage_cpu([JsonlReader(path("in")), MinhashDedupFilter(path("remove"))],
                                     tasks, path("logs", "filter"))
    return row


def scale(args) -> None:
    rows = []
    for size in args.sizes:
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            rows.append(_scale_one(size, tmp, args.tasks))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| documents | MB | read | signature | buckets | cluster | filter | dup lines "
          "| cluster nodes | cluster peak RSS (MB) | over import (MB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rate = {k: r["documents"] / max(r[f"{k}_cpu_s"], 1e-9)
                for k in ("read", "signature", "buckets", "cluster", "filter")}
        print(f"| {r['documents']} | {r['bytes'] / 1e6:.0f} | {rate['read']:.0f} | "
              f"{rate['signature']:.0f} | {rate['buckets']:.0f} | {rate['cluster']:.0f} | "
              f"{rate['filter']:.0f} | {r['dup_lines']} | {r['cluster_nodes']} | {r['cluster_peak_mb']:.0f} | "
              f"{r['cluster_peak_mb'] - r['cluster_base_mb']:.1f} |")
    print("(rates: documents per CPU second of the stage, i.e. per core)")


def _prepare_run(cli: list[str], corpus: str, tokenizer: str, out: str, executor: str) -> dict:
    done = subprocess.run(cli + ["prepare", corpus, "--tokenizer", tokenizer, "--out", out,
                                 "--executor", executor, "--tasks", "2", "--workers", "2"],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"maxmoe data prepare --executor {executor} failed:\n{done.stderr[-3000:]}")
    shards = {}
    for root, _, names in os.walk(out):
        for name in names:
            if ".array_record" in name:
                with open(os.path.join(root, name), "rb") as f:
                    shards[os.path.relpath(os.path.join(root, name), out)] = hashlib.sha256(
                        f.read()).hexdigest()
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    return {"shards": shards, "dropped": manifest["dropped"],
            "written": manifest["documents_written"]}


def prepare(args) -> None:
    cli = [sys.executable, "-m", "maxmoe.cli", "data"]
    spec = sd.CorpusSpec(documents=args.documents, files=2, seed=args.seed)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        corpus, path = os.path.join(tmp, "in"), functools.partial(os.path.join, tmp)
        truth = sd.generate(spec, corpus)
        _, kept = sd.run_local(corpus, path("direct"), tasks=2)
        subprocess.run(cli + ["tokenizer", corpus, "--vocab-size", "1000", "--out", path("tok")],
                       check=True, capture_output=True, text=True)
        runs = {ex: _prepare_run(cli, corpus, path("tok"), path(ex), ex) for ex in ("local", "ray")}
    documents = len(truth.unrelated) + 2 * len(truth.hard_negatives) + len(
        {c for _, c, *_ in truth.near_dups}) + len({o for o, *_ in truth.near_dups})
    print(f"corpus: {documents} documents, {len(truth.near_dups)} planted copies")
    print(f"direct datatrove run (run_local, 2 tasks): {documents - len(kept)} near-duplicates "
          "removed")
    for ex, run in runs.items():
        print(f"maxmoe data prepare --executor {ex} --tasks 2: dropped {run['dropped']}, "
              f"written {run['written']}, {len(run['shards'])} shard files")
    same = runs["local"]["shards"] == runs["ray"]["shards"]
    print(f"local and ray shards byte-identical: {same}")


def prepare_scale(args) -> None:
    import maxmoe.data.prepare as prep
    from maxmoe.data.executors import LaunchOptions

    cpu: dict[str, float] = {}

    class Timed:  # the stage's executor, with the CPU seconds of its run() recorded
        def __init__(self, executor, name):
            self.executor, self.name = executor, name

        def run(self):
            start = time.process_time()
            self.executor.run()
            cpu[self.name] = time.process_time() - start

        def get_incomplete_ranks(self):
            return self.executor.get_incomplete_ranks()

    real = prep.executor_for
    prep.executor_for = lambda stage, *a: Timed(real(stage, *a), stage.name)
    cli = [sys.executable, "-m", "maxmoe.cli", "data"]
    print("| documents | MB | " + " | ".join(STAGES) + " |")
    print("|---|---|" + "---|" * len(STAGES))
    for size in args.sizes:
        cpu.clear()
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            corpus = os.path.join(tmp, "in")
            sd.generate(sd.CorpusSpec(documents=size, hard_negative_fraction=0.02, files=2,
                                      seed=size), corpus)
            megabytes = sum(os.path.getsize(os.path.join(corpus, f))
                            for f in os.listdir(corpus)) / 1e6
            subprocess.run(cli + ["tokenizer", corpus, "--vocab-size", "4000", "--out",
                                  os.path.join(tmp, "tok")], check=True, capture_output=True)
            prep.prepare([corpus], os.path.join(tmp, "tok"), os.path.join(tmp, "out"),
                         prep.PrepareOptions(tasks=2, launch=LaunchOptions(workers=1)))
        print(f"| {size} | {megabytes:.0f} | "
              + " | ".join(f"{size / cpu[s]:.0f}" if s in cpu else "-" for s in STAGES) + " |",
              flush=True)
    print("(documents per CPU second of each stage of maxmoe data prepare, i.e. per core)")


def exact_split(args) -> None:
    from datatrove.pipeline.dedup.exact_dedup import ExactDedupConfig, ExactFindDedups

    from maxmoe.data.stages import ExactSignature, _text

    config = ExactDedupConfig(content_getter=_text)
    rng = np.random.default_rng(0)
    per_task = args.documents // args.clean_tasks
    pool = rng.integers(0, 2**64, size=int(args.documents * 0.7), dtype=np.uint64)
    print("| finder tasks k | hashes | CPU s per finder task (max) | hashes per CPU s per task |")
    print("|---|---|---|---|")
    for finders in args.finders:
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            step = ExactSignature(os.path.join(tmp, "sigs"), config, finder_workers=finders)
            for rank in range(args.clean_tasks):
                step.priority = 65535 - rank
                hashes = rng.choice(pool, size=per_task)  # draws repeat: exact copies
                step.save_hashes(rank, [(int(h), step.priority, i) for i, h in enumerate(hashes)])
            seconds = []
            for rank in range(finders):
                finder = ExactFindDedups(os.path.join(tmp, "sigs"), os.path.join(tmp, "dups"),
                                         config)
                start = time.process_time()
                finder.run(rank=rank, world_size=finders)
                seconds.append(time.process_time() - start)
        total = per_task * args.clean_tasks
        print(f"| {finders} | {total} | {max(seconds):.1f} | {total / sum(seconds):.0f} |",
              flush=True)


STAGES = ("clean", "exact", "signatures", "buckets", "cluster", "write", "manifest")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("scan").set_defaults(run=scan)
    q = sub.add_parser("quality")
    q.add_argument("--documents", type=int, default=20000)
    q.add_argument("--tasks", type=int, default=4)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--params", choices=("maxmoe", "fineweb"), default="maxmoe")
    q.set_defaults(run=quality)
    s = sub.add_parser("scale")
    s.add_argument("--sizes", type=int, nargs="+", default=[10000, 30000, 100000])
    s.add_argument("--tasks", type=int, default=4)
    s.set_defaults(run=scale)
    r = sub.add_parser("prepare")
    r.add_argument("--documents", type=int, default=4000)
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(run=prepare)
    ps = sub.add_parser("prepare-scale")
    ps.add_argument("--sizes", type=int, nargs="+", default=[10000, 30000])
    ps.set_defaults(run=prepare_scale)
    x = sub.add_parser("exact-split")
    x.add_argument("--clean-tasks", type=int, default=64)
    x.add_argument("--documents", type=int, default=2000000)
    x.add_argument("--finders", type=int, nargs="+", default=[1, 4])
    x.set_defaults(run=exact_split)
    for p in (q, s, r, ps, x):
        p.add_argument("--tmp", default=None, help="folder for the corpus and stage outputs")
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
