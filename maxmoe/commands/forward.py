"""`maxmoe forward CKPT_DIR --input ids.npy --output logits.npy`: one forward pass on one device.

The tool to check a conversion: token ids [B, S] (or [S]) in, logits [B, S, V] float32 out,
computed in float32 unless --dtype says otherwise (bfloat16 flips experts at routing boundaries).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("forward", help="run a checkpoint on token ids, save the logits",
                              description=__doc__.split("\n", 1)[1].strip())
    p.add_argument("ckpt_dir", help="a 'convert from-hf' output or a training run directory")
    p.add_argument("--input", required=True, help=".npy of int token ids [B, S] or [S]")
    p.add_argument("--output", required=True, help=".npy to write the float32 logits to")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="compute dtype (params are float32 either way)")
    p.set_defaults(run=run)


def run(args) -> int:
    """Writes the logits of --input to --output; exit 0, or 2 with one line on a bad input."""
    # late: the forward pass imports JAX; keeps `maxmoe --help` free of it
    from maxmoe.convert.forward import forward_logits
    from maxmoe.hf.safetensors_io import ConversionError

    if not Path(args.input).is_file():
        print(f"maxmoe: error: --input {args.input!r}: not found; pass a .npy of token ids",
              file=sys.stderr)
        return 2
    ids = np.load(args.input)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        print(f"maxmoe: error: --input {args.input!r}: expected integer ids [B, S] or [S], got "
              f"{ids.dtype} {list(ids.shape)}", file=sys.stderr)
        return 2
    try:
        logits = forward_logits(args.ckpt_dir, ids, args.dtype)
    except ConversionError as e:
        print(f"maxmoe: error: {e}", file=sys.stderr)
        return 2
    np.save(args.output, logits)
    print(f"maxmoe forward: logits {list(logits.shape)} -> {args.output}", file=sys.stderr)
    return 0
