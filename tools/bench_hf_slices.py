"""Peak RSS and time of reading an HF checkpoint whole (from_hf.read_hf) vs one process's share
of every leaf (hf/slices.LeafReader, 1/N of each leaf along its expert dim, else its
first dim N divides), each in a fresh subprocess (getrusage(RUSAGE_CHILDREN): C++ and mmap
pages included; "baseline" is the imports and the reader's set-up alone):

    python tools/make_random_hf_checkpoint.py configs/models/tiny_deepseek_v3.yaml /tmp/hub \\
        model.hidden_size=1024 moe.num_experts=64 moe.expert_mlp_size=512 model.num_layers=5
    python tools/bench_hf_slices.py /tmp/hub --share 8
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _share_index(shape: tuple[int, ...], n: int, part: int) -> tuple[slice, ...]:
    """Part `part` of n of a leaf: along the expert dim of [L, E, ...] leaves, else dim 0."""
    dims = [1] if len(shape) == 4 else []
    dims += [d for d in range(len(shape)) if d not in dims]
    for d in dims:
        if shape[d] % n == 0:
            step = shape[d] // n
            return tuple(slice(part * step, (part + 1) * step) if i == d else slice(None)
                         for i in range(len(shape)))
    return tuple(slice(None) for _ in shape)


def child(hf_dir: str, mode: str, share: int) -> dict:
    """Runs in the subprocess: reads, returns bytes read into float32 and seconds."""
    sys.path.insert(0, str(ROOT))
    import jax
    import numpy as np

    from maxmoe.convert.from_hf import read_hf
    from maxmoe.hf.slices import LeafReader

    t = time.perf_counter()
    if mode == "baseline":  # imports and the reader's set-up, nothing read
        LeafReader(hf_dir)
        nbytes = 0
    elif mode == "whole":
        _, params, _, _ = read_hf(Path(hf_dir))
        nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    else:
        reader = LeafReader(hf_dir)
        nbytes = 0
        for path, shape in reader.shapes().items():
            block = reader.read(path, _share_index(shape, share, 0))
            nbytes += block.nbytes
            del block  # one leaf's share at a time, as make_array_from_callback hands it over
        assert np.isfinite(nbytes)
    return {"mode": mode, "float32_bytes": nbytes, "seconds": round(time.perf_counter() - t, 2)}


def measure(hf_dir: str, mode: str, share: int) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out = subprocess.run([sys.executable, __file__, hf_dir, "--child", mode, "--share",
                          str(share)], check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # ru_maxrss of children is the largest child so far: run the smaller reads first
    result["peak_rss_mib"] = round(max(peak, before) / 1024, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir")
    parser.add_argument("--share", type=int, default=8)
    parser.add_argument("--child", default="")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.hf_dir, args.child, args.share)))
        return
    size = sum(p.stat().st_size for p in Path(args.hf_dir).glob("*.safetensors"))
    print(json.dumps({"safetensors_mib": round(size / 2**20, 1), "share": args.share}))
    for mode in ("baseline", "share", "whole"):  # smaller first: RUSAGE_CHILDREN keeps the max
        print(json.dumps(measure(args.hf_dir, mode, args.share)))


if __name__ == "__main__":
    main()
