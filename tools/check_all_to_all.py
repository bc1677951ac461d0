"""The AllToAll (or TwoLevel) transport's kernels alone on this machine's devices, against
AllGather.

    python3 tools/check_all_to_all.py [--tokens 4096 --dim 1024 --ffn 512 --experts 64 --topk 6]
    python3 tools/check_all_to_all.py --transport two_level [--hosts 1]

An `expert` mesh axis over every local device (one GPU: an axis of size 1, which still runs
`lax.ragged_all_to_all`; CPU: the dense all_to_all form). Two routings: random (top-k of
random scores) and worst case (every token to experts 0 .. K-1, so one shard gets it all and
several rounds run at buffer factor 0.25, even on an axis of size 1). Prints per routing the rounds, the largest
difference of y and of the gradients (x, router weights, expert weights) from AllGather's,
each relative to the reference's largest magnitude; exits 1 if one exceeds --tolerance.
--transport two_level: TwoLevel over --hosts hosts of the axis (1 on one GPU: hop 1 is then a
ragged_all_to_all within a group of one, hop 2 the rounds; its result does not depend on the
routing being group-limited, only its cross-host traffic does).
float32 inputs (GPUs may run float32 matmuls as TF32: hence the default 1e-2).
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from maxmoe.config import MoEConfig
from maxmoe.parallel.dispatch import AllGather, AllToAll, ExpertShards
from maxmoe.parallel.two_level import TwoLevel


def run(kind, cfg: MoEConfig, mesh, args):
    """loss, y, grads of `kind` (AllGather / AllToAll) over the mesh's expert axis."""
    n = mesh.shape["expert"]
    shards = ExpertShards(axes=("expert",), sizes=(n,), gathered=("expert",), sync=("expert",))

    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P("expert"),) * 6,
                       out_specs=(P("expert"), P()), check_vma=False)
    def body(x, idx, w, wg, wu, wd):
        y, _, rounds = kind(cfg, shards)(x, idx, w, wg, wu, wd)
        return y, rounds

    def loss(x, w, wg, wu, wd, idx):
        y, rounds = body(x, idx, w, wg, wu, wd)
        return jnp.sum(jnp.sin(y)), (y, rounds)
    x, idx, w, wg, wu, wd = args
    grad = jax.jit(jax.value_and_grad(loss, argnums=range(5), has_aux=True))
    (_, (y, rounds)), grads = grad(x, w, wg, wu, wd, idx)
    return y, int(rounds), grads


def inputs(a, n: int, worst: bool):
    keys = jax.random.split(jax.random.key(0), 6)
    t = a.tokens * n
    x = jax.random.normal(keys[0], (t, a.dim), jnp.float32)
    if worst:
        idx = jnp.broadcast_to(jnp.arange(a.topk, dtype=jnp.int32), (t, a.topk))
    else:
        idx = jax.lax.top_k(jax.random.normal(keys[1], (t, a.experts)), a.topk)[1]
    w = jax.random.uniform(keys[2], (t, a.topk))
    scale = a.dim ** -0.5
    wg, wu = (scale * jax.random.normal(k, (a.experts, a.dim, a.ffn)) for k in keys[3:5])
    wd = a.ffn ** -0.5 * jax.random.normal(keys[5], (a.experts, a.ffn, a.dim))
    return x, idx, w, wg, wu, wd


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="per device")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--tolerance", type=float, default=1e-2)
    p.add_argument("--transport", choices=["all_to_all", "two_level"], default="all_to_all")
    p.add_argument("--hosts", type=int, default=1, help="two_level: hosts of the expert axis")
    a = p.parse_args()
    kind = AllToAll if a.transport == "all_to_all" else functools.partial(TwoLevel,
                                                                          hosts=a.hosts)
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("expert",), devices=devices,
                         axis_types=(jax.sharding.AxisType.Auto,))
    print(f"devices: {len(devices)} x {devices[0].platform} ({devices[0].device_kind}), "
          f"transport {a.transport}")
    ok = True
    for worst in (False, True):
        cfg = MoEConfig(num_experts=a.experts, experts_per_token=a.topk,
                        transport_buffer_factor=0.25 if worst else 1.5)
        args = inputs(a, len(devices), worst)
        y_ref, _, g_ref = run(AllGather, cfg, mesh, args)
        y, rounds, grads = run(kind, cfg, mesh, args)
        errs = {"y": _rel(y, y_ref)}
        errs.update({name: _rel(g, r) for name, g, r in zip(
            ("dx", "dweights", "dw_gate", "dw_up", "dw_down"), grads, g_ref, strict=True)})
        print(f"{'worst-case' if worst else 'random'} routing: {rounds} rounds; max |diff| / "
              "max |ref|: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
        ok &= max(errs.values()) <= a.tolerance and (not worst or rounds > 1)
    print("ok" if ok else "MISMATCH")
    return 0 if ok else 1


def _rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(a - ref)) / max(np.max(np.abs(ref)), 1e-30))


if __name__ == "__main__":
    sys.exit(main())
