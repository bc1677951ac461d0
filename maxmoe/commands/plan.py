"""`maxmoe plan CONFIG... [KEY=VALUE...] --cluster CLUSTER [--tokens N] [--search]`: memory,
step time and cost of a config on a cluster, by compiling the real train step on fake CPU
devices (maxmoe/plan/)."""

from __future__ import annotations

import argparse
import json
import sys

USAGE = """\
Plan a run before renting the cluster: compile the real train step for the cluster's device
count on fake CPU devices (no memory is allocated) and report, per device, the memory by part
(parameters, gradients, optimizer state, temporaries), the largest buffers, the state leaves no
mesh axis shards, the collective bytes per step by mesh axis (inside and across hosts), a
roofline step time, MFU, and the cost of --tokens (or train.steps). Examples:

  maxmoe plan configs/models/deepseek_13b.yaml --cluster 8xh200 mesh.fsdp=8 data.seq_len=4096
  maxmoe plan configs/models/deepseek_v3_671b.yaml --cluster 2048xh800 --search --tokens 14.8T

CLUSTER is a file under configs/cluster/ (e.g. deepseek_v3_h800) or COUNTxKIND built from
configs/devices/KIND.yaml (h800, h100, h200, b200, cpu). --search considers every mesh (and host
split, remat policy and microbatches) that passes validation, ranks them by an analytic
estimate and compiles the best --top of them (--ignore-memory: the fastest, fitting or not,
to weigh a layout that fits against). The last line is one JSON object; --write FILE
saves the best layout as a config to pass after the model's. --compiler auto (the default)
compiles with XLA:GPU's own deviceless compile where jax's CUDA plugin is installed and the
cluster's devices are NVIDIA GPUs with a gpu_target in configs/devices/ (no GPU needed;
docs/gpu_aot.md), else with XLA:CPU, saying so in one line."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="memory, step time and cost of a config on a cluster",
                              description=USAGE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("items", nargs="+", metavar="CONFIG_OR_KEY=VALUE")
    p.add_argument("--cluster", required=True, help="configs/cluster/ file or COUNTxKIND")
    p.add_argument("--tokens", default="", help="tokens to train, e.g. 14.8T (default: "
                                                "train.steps x the global batch)")
    p.add_argument("--search", action="store_true", help="search the layouts, compile the best")
    p.add_argument("--top", type=int, default=4, help="--search: layouts compiled (default 4)")
    p.add_argument("--ignore-memory", action="store_true",
                   help="--search: rank by step time alone, fitting or not (the fastest layout's "
                        "cost, to weigh a layout that fits against)")
    p.add_argument("--write", metavar="FILE", default="", help="save the best layout as a config")
    p.add_argument("--compiler", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto (default): gpu where it can, else cpu; cpu: XLA:CPU on fake "
                        "devices; gpu: XLA:GPU on deviceless GPUs of the cluster's kind (a "
                        "configs/devices/ kind with a gpu_target; needs jax[cuda12])")
    p.add_argument("--load-imbalance", type=float, default=None, metavar="RATIO",
                   help="busiest expert shard's tokens over the mean, slowing the dispatch and "
                        "the routed experts (default: plan/roofline.py DEFAULT_LOAD_IMBALANCE)")
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds one compile may take (default 900)")
    p.set_defaults(run=run)


def run(args) -> int:
    """Plans one layout (the config's) or --search; prints the table, details and JSON. Exit 0
    when the best layout fits, 1 when the measured layout does not, 2 on bad input."""
    # late: the planner imports JAX and the model; `maxmoe --help` stays free of them
    from maxmoe.plan.planner import plan

    result = plan(args.items, args.cluster, tokens=args.tokens, search_layouts=args.search,
                  top=args.top, write=args.write, timeout_s=args.timeout, compiler=args.compiler,
                  ignore_memory=args.ignore_memory, load_imbalance=args.load_imbalance,
                  out=sys.stdout)
    print(json.dumps(result["best"]))
    return 0 if result["best"]["fits"] else 1
