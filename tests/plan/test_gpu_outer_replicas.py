"""The outer part's row-group loop under mesh.weights=zero1, XLA:GPU's deviceless compile.

The LM head, the final norm and MTP's final norm are read inside the loop over row groups
(model.outer_microbatches), the head twice (main and MTP loss). Replicated over every axis
that splits the outer rows, their weight gradients were all-reduced over all those axes once
per row group, inside the loop (the 671B recipe's largest exposed collectives: issue 41). On
one replica per group of those axes (train/gradients.py ComputeCopy.outer, the loss vmapped
over them: parallel/replicas.py on_outer_replicas), the replicas' gradients are added once
per step, after the loop. Checked: no reduction (all-reduce, reduce-scatter) of >= SMALL result
bytes of the head or a final norm (an op named .../lm_head/..., where they are read) whose
device groups span a batch axis inside a row-group loop, on a tiny DeepSeek-like proxy
(MLA, MTP depth 1, chunked head) on 16 deviceless H100s in 2 hosts (fsdp 2 across them x
expert 4 x pipeline 2, the MoE layers pipelined), bf16. Main's step fails it (its head
gradient all-reduce is found). The `gpu_aot` group. (The MTP block's own params, read in
the loop too, are not on replicas: their gradients are still reduced there, one small
reduce-scatter per row group.)
"""

import re

import numpy as np
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="jax[cuda12] plugin not installed")
pytest.importorskip("tokamax", reason="tokamax not installed")

from maxmoe.plan.collectives import replica_groups  # noqa: E402
from maxmoe.plan.hlo import attr, callees, parse_module, shape_bytes  # noqa: E402
from maxmoe.plan.probe import compile_step  # noqa: E402

pytestmark = pytest.mark.gpu_aot

PROXY = ["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml", "mesh.weights=zero1",
         "precision.compute_dtype=bfloat16", "data.seq_len=64", "data.global_batch_size=32",
         "model.num_layers=5", "model.outer_microbatches=2", "model.lm_loss_chunk=32",
         "model.pipeline_microbatches=4", "mesh.data=1", "mesh.fsdp=2", "mesh.dcn_fsdp=2",
         "mesh.expert=4", "mesh.pipeline=2"]
SMALL = 1024  # bytes: above the loss's scalar reductions, below the final norm's gradient
BATCH_AXES = ("data", "fsdp", "expert", "pipeline")


def _op_name(ins) -> str:
    found = re.search(r'op_name="([^"]*)"', attr(ins.attrs, "metadata") or "")
    return found.group(1) if found else ""


def _reach(comps, name: str) -> set[str]:
    """The computations `name` calls, itself included, transitively (loop bodies too)."""
    seen, todo = set(), [name]
    while todo:
        c = todo.pop()
        if c not in seen and c in comps:
            seen.add(c)
            todo += [callee for ins in comps[c] for callee in callees(ins)]
    return seen


def row_group_reductions(hlo: str, mesh) -> list[str]:
    """Reductions of the head's or a final norm's gradient (op named .../lm_head/...) of >=
    SMALL result bytes over device groups spanning a batch axis, inside a loop that runs the
    LM head: the row-group loops, forward and backward, and the chunked head's loops in them."""
    comps, _ = parse_module(hlo)
    names = list(mesh.shape)
    coords = np.array(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)).T
    inside = set()
    for ins in (i for comp in comps.values() for i in comp if i.opcode == "while"):
        body = _reach(comps, attr(ins.attrs, "body").lstrip("%"))
        if any("lm_head" in _op_name(i) for c in body for i in comps[c]):
            inside |= body
    found = []
    for ins in (i for c in inside for i in comps[c]):
        if not ins.opcode.startswith(("all-reduce", "reduce-scatter")) or \
                ins.opcode.endswith("done") or shape_bytes(ins.type) < SMALL or \
                "lm_head" not in _op_name(ins):
            continue
        c = coords[np.asarray(replica_groups(ins.attrs, mesh.devices.size))]
        varies = (c != c[:, :1]).any(axis=(0, 1))
        if any(varies[names.index(a)] for a in BATCH_AXES if a in names):
            found.append(f"{ins.opcode} {ins.type[:50]} {_op_name(ins)[-90:]}")
    return found


def test_row_group_loop_reduces_no_outer_gradient():
    setup, step, _ = compile_step(PROXY, 16, 2, "gpu", "h100")
    hlo, mesh = step.as_text(), setup.trainer.mesh
    assert any("lm_head" in line for line in hlo.splitlines() if "while" in line)
    assert row_group_reductions(hlo, mesh) == []
