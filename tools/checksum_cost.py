"""What checkpoint checksums cost at save time (issue 38.5,
docs/performance/checkpoints-and-hugging-face.md "Checkpoint
checksums").

    python tools/checksum_cost.py [configs/tiny.yaml] [KEY=VALUE...] [--saves 6]

Builds the config's train state on its mesh (fake CPU devices as `maxmoe train` would), then
saves it --saves times with checkpoint.checksums=true and =false in turns (async, as the
train loop saves; each save waited for before the next), timing the call that blocks the loop
(`Checkpointer.save`) and, apart, `checksums.compute` alone, and the verify of one step (the
read-back a restore adds). The first save of each arm is a warm-up and not counted. Prints
medians; the last line is JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("items", nargs="*", default=["configs/tiny.yaml"])
    parser.add_argument("--saves", type=int, default=6)
    args = parser.parse_args()

    from maxmoe.commands.setup import configure

    cfg, sizes = configure(args.items)
    import jax

    from maxmoe.train import checksums
    from maxmoe.train.checkpoint import Checkpointer
    from maxmoe.train.setup import prepare_run

    state = prepare_run(cfg, sizes).trainer.init()
    jax.block_until_ready(state)
    hashed = sum(shard.data.nbytes for leaf in jax.tree.leaves(state)
                 for shard in leaf.addressable_shards if shard.replica_id == 0)
    blocking = {True: [], False: []}
    compute_s = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = {on: Checkpointer(Path(tmp) / str(on), dataclasses.replace(
            cfg.checkpoint, checksums=on, every_steps=1, keep=2)) for on in (True, False)}
        for i in range(args.saves + 1):
            for on in (True, False):
                t = time.perf_counter()
                ckpts[on].save(i + 1, state)
                seconds = time.perf_counter() - t
                ckpts[on].wait()
                if i:
                    blocking[on].append(seconds)
            t = time.perf_counter()
            checksums.compute(state)
            if i:
                compute_s.append(time.perf_counter() - t)
        step = Path(tmp) / "True" / str(args.saves + 1)
        t = time.perf_counter()
        bad, read = checksums.verify(step / "state", checksums.read(step / checksums.ITEM))
        verify_s = time.perf_counter() - t
        assert not bad
        for ckpt in ckpts.values():
            ckpt.close()
    on, off, hash_s = (statistics.median(blocking[True]), statistics.median(blocking[False]),
                       statistics.median(compute_s))
    result = {"config": args.items, "state_bytes_hashed": hashed, "saves": args.saves,
              "compute_s": round(hash_s, 4), "hash_bytes_per_s": round(hashed / hash_s),
              "save_blocking_s_on": round(on, 4), "save_blocking_s_off": round(off, 4),
              "hash_share_of_blocking_on": round(hash_s / on, 3),
              "verify_s": round(verify_s, 4), "verify_bytes_per_s": round(read / verify_s)}
    print(f"state {hashed / 2**20:.1f} MiB hashed per save (replica 0 of each shard) in "
          f"{hash_s * 1e3:.1f} ms = {hashed / hash_s / 2**30:.2f} GiB/s")
    print(f"Checkpointer.save blocks {on * 1e3:.1f} ms with checksums, {off * 1e3:.1f} ms "
          f"without (median of {args.saves}); hashing is {hash_s / on:.0%} of the former")
    print(f"verify (read back + hash, one process): {verify_s * 1e3:.1f} ms = "
          f"{read / verify_s / 2**30:.2f} GiB/s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
