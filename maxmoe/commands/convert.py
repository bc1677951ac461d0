"""`maxmoe convert from-hf HF_DIR OUT_DIR` and `maxmoe convert to-hf CKPT_DIR OUT_DIR`.

The conversions themselves are maxmoe/convert/from_hf.py and maxmoe/convert/to_hf.py.
"""

from __future__ import annotations

import argparse
import sys
import time

from maxmoe.config import ConfigError
from maxmoe.distributed import initialize, wait_for_processes

# a barrier waits for the slowest process's whole share of the model; a process that dies is
# caught by jax.distributed's heartbeat long before this
BARRIER_TIMEOUT_S = 24 * 3600

USAGE = """\
Convert checkpoints between Hugging Face safetensors (DeepSeek-V3, DeepSeek-V2, Mixtral,
Qwen3-MoE hub layouts) and maxmoe.

  maxmoe convert from-hf HF_DIR OUT_DIR     config.json + model*.safetensors (single file or
                                            sharded with an index; FP8 block-scaled weights are
                                            dequantized) -> OUT_DIR/config.yaml + OUT_DIR/params
                                            (written chunk by chunk: memory stays about one hub
                                            tensor; run it on N processes of a jax.distributed
                                            job, e.g. launch/local_multiprocess.sh, and each
                                            writes 1/N of the chunks to the shared OUT_DIR)
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
    a.add_argument("--chunk-mb", type=float, default=64.0,
                   help="largest chunk of a param array in MiB (the unit read and written)")
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
    from maxmoe.convert.to_hf import convert_to_hf
    from maxmoe.hf.safetensors_io import ConversionError

    t = time.perf_counter()
    try:
        if args.direction == "from-hf":
            print(_from_hf(args, convert_from_hf), file=sys.stderr)
        else:
            convert_to_hf(args.ckpt_dir, args.out_dir, args.dtype,
                          int(args.max_shard_gb * 2**30))
    except ConversionError as e:
        print(f"maxmoe: error: {e}", file=sys.stderr)
        return 2
    print(f"maxmoe convert {args.direction}: wrote {args.out_dir} in "
          f"{time.perf_counter() - t:.1f}s", file=sys.stderr)
    return 0


def _from_hf(args, convert_from_hf) -> str:
    """Joins jax.distributed when the environment names a job (maxmoe/distributed.py), then
    converts as this process's share of it; returns the line saying what it wrote."""
    if not args.chunk_mb > 0:
        raise ConfigError(f"--chunk-mb {args.chunk_mb}: a chunk needs a size above 0 MiB; "
                          "leave it out for 64")
    member = initialize()
    index, count = (member.process_id, member.num_processes) if member else (0, 1)
    _, written = convert_from_hf(
        args.hf_dir, args.out_dir, max_chunk_bytes=int(args.chunk_mb * 2**20),
        process_index=index, process_count=count,
        barrier=lambda name: wait_for_processes(name, BARRIER_TIMEOUT_S))
    return (f"maxmoe convert from-hf: process {index} of {count} wrote {written.chunks} of "
            f"{written.total} chunks ({written.nbytes / 2**20:.1f} MiB)")
