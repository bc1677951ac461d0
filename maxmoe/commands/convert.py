"""`maxmoe convert from-hf HF_DIR OUT_DIR` and `maxmoe convert to-hf CKPT_DIR OUT_DIR`.

The conversions themselves are maxmoe/convert/from_hf.py and maxmoe/convert/to_hf.py.
"""

from __future__ import annotations

import argparse
import sys
import time

USAGE = """\
Convert checkpoints between Hugging Face safetensors (DeepSeek-V3, DeepSeek-V2, Mixtral,
Qwen3-MoE hub layouts) and maxmoe.

  maxmoe convert from-hf HF_DIR OUT_DIR     config.json + model*.safetensors (single file or
                                            sharded with an index; FP8 block-scaled weights are
                                            dequantized) -> OUT_DIR/config.yaml + OUT_DIR/params
  maxmoe convert to-hf CKPT_DIR OUT_DIR     a converted checkpoint or a training run directory
                                            -> OUT_DIR/config.json + safetensors with hub names

Check a conversion with 'maxmoe forward OUT_DIR --input ids.npy --output logits.npy'."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("convert", help="Hugging Face safetensors <-> maxmoe checkpoints",
                              description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    a = sub.add_parser("from-hf", help="Hugging Face directory -> maxmoe checkpoint directory")
    a.add_argument("hf_dir")
    a.add_argument("out_dir")
    b = sub.add_parser("to-hf", help="maxmoe checkpoint directory -> Hugging Face directory")
    b.add_argument("ckpt_dir")
    b.add_argument("out_dir")
    b.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), default=None,
                   help="dtype of every tensor (default: the source dtypes, else bfloat16)")
    b.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="largest safetensors file in GB; more tensors go to the next shard")
    p.set_defaults(run=run)


def run(args) -> int:
    """Converts one checkpoint; exit 0, or 2 with one line when the input cannot be converted."""
    # late: the conversions import JAX; keeps `maxmoe --help` free of it
    from maxmoe.convert.from_hf import convert_from_hf
    from maxmoe.convert.safetensors_io import ConversionError
    from maxmoe.convert.to_hf import convert_to_hf

    t = time.perf_counter()
    try:
        if args.direction == "from-hf":
            convert_from_hf(args.hf_dir, args.out_dir)
        else:
            convert_to_hf(args.ckpt_dir, args.out_dir, args.dtype,
                          int(args.max_shard_gb * 2**30))
    except ConversionError as e:
        print(f"maxmoe: error: {e}", file=sys.stderr)
        return 2
    print(f"maxmoe convert {args.direction}: wrote {args.out_dir} in "
          f"{time.perf_counter() - t:.1f}s", file=sys.stderr)
    return 0
