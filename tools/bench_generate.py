"""Tokens/s of `maxmoe generate`'s decode loop on a randomly initialised model of a config.

    python -m tools.bench_generate configs/models/deepseek_13b.yaml model.num_layers=3 \\
        model.mtp_depth=0 --batch 1 --prompt 32 --new 32 [--mesh tensor=2] [--dtype bfloat16]

Random prompts, EOS off (every step runs); prints prefill and decode tokens/s and compile time.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from flax import nnx

from maxmoe.config_files import load_config
from maxmoe.generate import decode
from maxmoe.generate.decode import Decoder
from maxmoe.generate.mesh import parse_mesh
from maxmoe.model.transformer import build_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("items", nargs="+", help="config files and KEY=VALUE overrides")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--mesh", default="")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--grouped-matmul", default="", help="override the config's choice")
    args = p.parse_args()
    cfg, _ = load_config([a for a in args.items if "=" not in a],
                         [a for a in args.items if "=" in a])
    if args.grouped_matmul:  # measure another kernel: patch the decode config's choice
        chosen = decode.decode_config
        def with_kernel(c, d, experts_split=False):
            base = chosen(c, d, experts_split)
            return dataclasses.replace(base, moe=dataclasses.replace(
                base.moe, grouped_matmul=args.grouped_matmul))
        decode.decode_config = with_kernel
    t0 = time.perf_counter()
    params = nnx.to_pure_dict(nnx.state(build_model(cfg, 0)))
    decoder = Decoder(cfg, params, dtype=args.dtype,
                      mesh=parse_mesh(args.mesh) if args.mesh else None)
    init = time.perf_counter() - t0
    ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (args.batch, args.prompt))
    out = decoder.generate(ids.astype(np.int32), np.zeros(args.batch, np.int32), args.new)
    b = args.batch
    print(f"init {init:.1f} s, compile {out.compile_s:.1f} s; prefill {b * args.prompt} tokens "
          f"{b * args.prompt / out.prefill_s:.1f} tokens/s; decode {out.steps} steps x {b} "
          f"{b * out.steps / out.decode_s:.2f} tokens/s ({out.decode_s / out.steps * 1e3:.1f} "
          "ms/step)")


if __name__ == "__main__":
    main()
