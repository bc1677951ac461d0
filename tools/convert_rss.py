"""Peak resident memory of `maxmoe convert from-hf` on a Hugging Face checkpoint, against its
largest tensor; with --before REF also of the same command from git revision REF's sources:

    python tools/make_random_hf_checkpoint.py configs/models/deepseek_13b.yaml /tmp/hub2g \\
        model.num_layers=2 moe.num_experts=32 --shard-gb 1
    python tools/convert_rss.py /tmp/hub2g --before main

Each figure is `resource.getrusage(RUSAGE_CHILDREN).ru_maxrss` of a fresh parent whose only
child is the measured command (so no earlier child's peak leaks in). `fixed` is the peak of a
process that imports the conversion, builds the abstract model and checks the tensor map (a
LeafReader) but moves no data: what remains above it is what the conversion holds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the fresh parent: runs argv[1:] as its only child, prints that child's peak RSS (KiB) + exit code
MEASURE = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)")
FIXED = ("import sys; import tensorstore; import maxmoe.convert.from_hf; "
         "from maxmoe.hf.slices import LeafReader; LeafReader(sys.argv[1])")


def peak_rss(argv: list[str], cwd: Path) -> int:
    """Peak RSS in bytes of the command argv run in cwd (raises if it fails)."""
    out = subprocess.run([sys.executable, "-c", MEASURE, *argv], cwd=cwd, check=True,
                         capture_output=True, text=True)
    kib, code = out.stdout.split()[-2:]
    if code != "0":
        raise RuntimeError(f"{argv} exited with {code}: {out.stderr[-2000:]}")
    return int(kib) * 1024


def largest_tensor(hf_dir: Path) -> tuple[str, int, int]:
    """(name, bytes on disk, elements) of the checkpoint's largest tensor."""
    from maxmoe.hf.safetensors_io import SafetensorsReader  # late: after sys.path is set

    reader = SafetensorsReader(hf_dir)
    sizes = {}
    for name in reader.names():
        view = reader.raw(name)  # memory-mapped: nothing is read
        sizes[name] = (view.nbytes, view.size)
    name = max(sizes, key=lambda n: sizes[n][0])
    return name, *sizes[name]


def convert_rss(hf_dir: Path, source: Path, out_dir: Path, extra: list[str] = ()) -> int:
    """Peak RSS in bytes of `maxmoe convert from-hf hf_dir out_dir` run from `source`."""
    try:
        return peak_rss([sys.executable, "-m", "maxmoe.cli", "convert", "from-hf", str(hf_dir),
                         str(out_dir), *extra], source)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def fixed_rss(hf_dir: Path) -> int:
    """Peak RSS in bytes of importing the conversion and checking the tensor map (no data)."""
    return peak_rss([sys.executable, "-c", FIXED, str(hf_dir)], ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir", type=Path)
    parser.add_argument("--before", help="git revision whose `convert from-hf` to measure too")
    parser.add_argument("--chunk-mb", type=float, default=None, help="passed to from-hf")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    hf_dir = args.hf_dir.resolve()
    name, nbytes, count = largest_tensor(hf_dir)
    total = sum(p.stat().st_size for p in hf_dir.glob("*.safetensors"))
    extra = ["--chunk-mb", str(args.chunk_mb)] if args.chunk_mb else []
    with tempfile.TemporaryDirectory() as tmp:
        result = {"checkpoint_gib": total / 2**30, "largest_tensor": name,
                  "largest_tensor_mib": nbytes / 2**20,
                  "largest_tensor_float32_mib": count * 4 / 2**20,
                  "fixed_mib": fixed_rss(hf_dir) / 2**20,
                  "after_mib": convert_rss(hf_dir, ROOT, Path(tmp) / "after", extra) / 2**20}
        if args.before:
            source = Path(tmp) / "before-src"
            source.mkdir()
            archive = subprocess.run(["git", "archive", args.before], cwd=ROOT, check=True,
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
            result["before"] = args.before
            result["before_mib"] = convert_rss(hf_dir, source, Path(tmp) / "before") / 2**20
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v
                      for k, v in result.items()}, indent=1))


if __name__ == "__main__":
    main()
