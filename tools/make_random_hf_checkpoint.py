"""Writes a random Hugging Face checkpoint (hub names, bf16, sharded) of a maxmoe preset, to
measure conversion time and memory on models too big for torch here:

    python tools/make_random_hf_checkpoint.py configs/models/deepseek_13b.yaml OUT_DIR \\
        model.num_layers=3 --shard-gb 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def write_random_checkpoint(cfg, out: Path, shard_bytes: int) -> int:
    """Writes config.json + random bf16 safetensors of the model cfg describes; returns the
    number of hub parameters."""
    from maxmoe.hf.config import config_to_hf, family_for
    from maxmoe.hf.names import hub_shape, hub_tensors, mtp_shared_copies
    from maxmoe.hf.safetensors_io import write_safetensors
    from maxmoe.model.transformer import abstract_params

    shapes = abstract_params(cfg)
    tensors = hub_tensors(cfg, family_for(cfg)) + mtp_shared_copies(cfg)
    plan = [(t.name, hub_shape(t, shapes), "BF16") for t in tensors]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg, None, "bfloat16"), indent=2))
    rng = np.random.default_rng(0)
    shape_of = {name: shape for name, shape, _ in plan}
    embed = rng.normal(0, 0.02, shape_of["model.embed_tokens.weight"]).astype(np.float32)
    head = rng.normal(0, 0.02, shape_of["lm_head.weight"]).astype(np.float32)

    def produce(name: str) -> np.ndarray:
        if name.endswith("embed_tokens.weight"):  # MTP copies must equal the main tensors
            return embed
        if name.endswith("lm_head.weight") or name.endswith("shared_head.head.weight"):
            return head
        if "norm" in name:
            return np.ones(shape_of[name], np.float32)
        return rng.normal(0, 0.02, shape_of[name]).astype(np.float32)

    write_safetensors(out, plan, produce, shard_bytes)
    return sum(int(np.prod(s)) for _, s, _ in plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset")
    parser.add_argument("out_dir")
    parser.add_argument("overrides", nargs="*", help="dotted KEY=VALUE config overrides")
    parser.add_argument("--shard-gb", type=float, default=5.0)
    args = parser.parse_args()

    from maxmoe.config_files import load_config

    cfg, _ = load_config([args.preset], args.overrides)
    total = write_random_checkpoint(cfg, Path(args.out_dir), int(args.shard_gb * 2**30))
    print(f"{args.out_dir}: {total / 1e9:.2f}B hub parameters")


if __name__ == "__main__":
    main()
