"""`maxmoe generate CKPT --prompt TEXT | --prompts-file F | --input ids.npy [options]`:
text from a checkpoint, with a KV cache (maxmoe/generate/)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from maxmoe.commands.bench import positive_int
from maxmoe.commands.setup import set_cpu_devices
from maxmoe.config import ConfigError

USAGE = """\
Generate from a checkpoint: the prompts are prefilled in one forward, then one token per step
with a KV cache, greedy (the default, --temperature 0) or sampled (--temperature, --top-p,
--seed), until EOS or --max-new-tokens. CKPT is a 'convert from-hf' output or a training run
directory (its newest checkpoint). Text prompts use the run's tokenizer (CKPT/tokenizer) or
--tokenizer DIR; --input gives token ids instead. Prompts of unequal lengths are left-padded
with --pad-id (default: the tokenizer's pad, else its EOS, else 0). Computed in float32 unless
--dtype says otherwise, on a mesh of the run's tensor x expert x fsdp sizes (data 1) or --mesh.

  maxmoe generate runs/sft --prompt "def fib(n):" --max-new-tokens 64
  maxmoe generate converted/ --input ids.npy --output out.npy --mesh tensor=2,expert=4

--output writes int32 ids [B, prompt + new]: the left-padded prompts, then the new tokens
(pad ids after a row's EOS). Tokens/s of prefill and decode are printed to stderr."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text from a checkpoint (KV cache)",
                              description=USAGE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ckpt", metavar="CKPT", help="a 'convert from-hf' output or a run directory")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeat for a batch)")
    p.add_argument("--prompts-file", metavar="FILE", help="a text file, one prompt per line")
    p.add_argument("--input", metavar="IDS", help=".npy of token ids [B, P] or [P], or .npz "
                   "of 1-D id arrays (ragged prompts)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sampling: keep the most likely tokens up to this mass (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--output", metavar="IDS", help=".npy to write the int32 ids to")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default "
                   "CKPT/tokenizer)")
    p.add_argument("--add-bos", action="store_true", help="start each text prompt with the "
                   "tokenizer's BOS id (released models that expect one)")
    p.add_argument("--pad-id", type=int, metavar="ID", help="id to left-pad prompts with and "
                   "fill after EOS")
    p.add_argument("--eos-id", type=int, metavar="ID",
                   help="id that ends a sequence (default: the tokenizer's; none without one)")
    p.add_argument("--mesh", default="", metavar="AXIS=N,...",
                   help="decode mesh, e.g. tensor=2,expert=4 (default: the run's tensor, "
                   "expert and fsdp sizes)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="compute dtype (default float32)")
    p.set_defaults(run=run)


def _check_args(args) -> None:
    given = bool(args.prompt or args.prompts_file) + bool(args.input)
    if given != 1:
        raise ConfigError("no prompt given: pass --prompt TEXT, --prompts-file FILE or "
                          "--input ids.npy" if not given else
                          "--input and --prompt/--prompts-file both given; pass one of them")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ConfigError(f"--temperature {args.temperature} / --top-p {args.top_p}: need "
                          "temperature >= 0 and 0 < top-p <= 1")
    if not Path(args.ckpt).is_dir():
        raise ConfigError(f"CKPT {args.ckpt!r}: not found; pass a 'convert from-hf' output or "
                          "a training run directory")


def run(args) -> int:
    """Generates, prints the texts (or ids) and tokens/s, writes --output; exit 0, or 2 with
    one line (ConfigError, via cli.py) on a bad input."""
    _check_args(args)
    # late: JAX, the model and the checkpoint reader; keeps `maxmoe --help` free of them
    from maxmoe.convert.checkpoint_io import read_converted, read_params
    from maxmoe.generate import prompts as P
    from maxmoe.generate.decode import Decoder, left_pad
    from maxmoe.generate.mesh import parse_mesh
    from maxmoe.generate.sampling import Sampling
    from maxmoe.hf.safetensors_io import ConversionError

    ckpt = Path(args.ckpt)
    try:
        cfg, hf_config, _ = read_converted(ckpt)
    except ConversionError as e:
        raise ConfigError(str(e)) from None
    tokenizer = P.find_tokenizer(ckpt, args.tokenizer, cfg.model.vocab_size)
    pad_id = next((i for i in (args.pad_id, getattr(tokenizer, "pad_id", None),
                               getattr(tokenizer, "eos_id", None)) if i is not None), 0)
    eos_id = args.eos_id if args.eos_id is not None else getattr(tokenizer, "eos_id", None)
    rows = (P.id_prompts(args.input, args.pad_id) if args.input
            else P.text_prompts(args.prompt, args.prompts_file, tokenizer))
    if args.add_bos and not args.input:
        if getattr(tokenizer, "bos_id", None) is None:
            raise ConfigError("--add-bos: the tokenizer has no BOS token; drop --add-bos")
        rows = [[tokenizer.bos_id, *row] for row in rows]
    P.check_prompts(rows, args.max_new_tokens, P.max_positions(cfg, hf_config),
                    cfg.model.vocab_size)
    mesh = parse_mesh(args.mesh) if args.mesh else None
    set_cpu_devices(cfg)
    try:
        params = read_params(ckpt, cfg)
    except ConversionError as e:
        raise ConfigError(str(e)) from None
    decoder = Decoder(cfg, params, dtype=args.dtype, mesh=mesh)
    ids, pad = left_pad(rows, pad_id)
    out = decoder.generate(ids, pad, args.max_new_tokens,
                           Sampling(args.temperature, args.top_p, args.seed), eos_id, pad_id)
    _report(out, ids, pad, tokenizer, args)
    return 0


def _report(out, ids, pad, tokenizer, args) -> None:
    """Each row's new text (or ids) on stdout; tokens/s on stderr; --output written."""
    b, p = ids.shape
    for row in range(b):
        new = out.tokens[row, p:].tolist()
        print(tokenizer.decode(new) if tokenizer is not None else " ".join(map(str, new)))
    real = int(b * p - pad.sum())
    print(f"maxmoe generate: prefill {real} tokens in {out.prefill_s:.3f} s "
          f"({real / max(out.prefill_s, 1e-9):.1f} tokens/s); decode {out.steps} steps x {b} "
          f"rows in {out.decode_s:.3f} s ({b * out.steps / max(out.decode_s, 1e-9):.1f} "
          f"tokens/s); compile {out.compile_s:.1f} s", file=sys.stderr)
    if args.output:
        np.save(args.output, out.tokens.astype(np.int32))
        print(f"maxmoe generate: ids {list(out.tokens.shape)} -> {args.output}",
              file=sys.stderr)
