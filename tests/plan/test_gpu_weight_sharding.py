"""mesh.weights=zero1 under XLA:GPU's deviceless compile.

- The gradient accumulation loop's own body (train.grad_accum_steps=4; not the loops nested in
  it) holds no collective of 64 KiB or more: the weights are gathered once before it and
  XLA:GPU's while-loop all-reduce code motion moves the gradient reduction after it
  (train/gradients.py), while zero3 gathers weights and reduces gradients in it at every
  microbatch.
- The loops nested in it (the layer scans; under the pipeline its iteration loop too) hold no
  reduction over the data-parallel axes (data, fsdp): the stacks run vmapped over one weight
  replica per device group (parallel/replicas.py), so no layer's weight gradient, attention,
  shared or routed experts', router or norm, is reduced there at every layer; zero3's scans
  do (the check can fire). With and without the pipeline.
- zero1 sends fewer bytes across hosts (plan/collectives.py's count).

- Nor over the expert axis, outside the MoE's shard_map (whose token exchanges run over it):
  the weights replicated over it (all but the routed experts') are read by the attention,
  norm, router and shared-expert sublayers vmapped over one replica per expert group
  (replicas.py on_sublayer_replicas), so their gradients are reduced once per step; zero3's
  scans reduce them per layer (the check can fire). With and without the pipeline.

XLA:CPU keeps the accumulation loop's reduction in the loop, so these are checked on the GPU
compile. The `gpu_aot` group; tiny on 16 deviceless H100s in 2 hosts (data 4
across them x fsdp 2 x expert 2; pipelined: data 2 x fsdp 2 x pipeline 2 x expert 2), bf16.
"""

import functools
import re

import numpy as np
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="jax[cuda12] plugin not installed")
pytest.importorskip("tokamax", reason="tokamax not installed")

from maxmoe.plan.collectives import collective_bytes, replica_groups  # noqa: E402
from maxmoe.plan.hlo import Instr, attr, callees, parse_module, shape_bytes  # noqa: E402
from maxmoe.plan.probe import compile_step  # noqa: E402

pytestmark = pytest.mark.gpu_aot

TINY = ["configs/tiny.yaml", "precision.compute_dtype=bfloat16", "train.grad_accum_steps=4",
        "data.global_batch_size=64", "mesh.data=4", "mesh.dcn_data=2"]
PIPELINED = ["mesh.data=2", "mesh.pipeline=2", "model.num_layers=5",
             "model.pipeline_microbatches=4", "data.global_batch_size=128"]
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
LARGE = 64 * 1024  # bytes: above every scalar and metric reduction of the tiny step
SMALL = 1024  # bytes: above the layer's metric reductions (a few floats), below a weight's
DATA_PARALLEL = ("data", "fsdp")


def _is_collective(ins: Instr) -> bool:
    return any(ins.opcode.startswith(c) for c in COLLECTIVES) and not ins.opcode.endswith("done")


def _accumulation_instructions(hlo: str, nested: bool):
    """(module computations, instructions) of the accumulation loop (the entry's while whose
    op_name ends in "train_step)/while"): with nested False those of its body and the
    computations it calls, not of the loops nested in it; with nested True only those of the
    nested loops (the layer scans, the pipeline's iterations) and what they call."""
    comps, entry = parse_module(hlo)
    loops = [ins for ins in comps[entry] if ins.opcode == "while"
             and 'train_step)/while"' in (attr(ins.attrs, "metadata") or "")]
    assert len(loops) == 1, [attr(i.attrs, "metadata") for i in loops]
    seen, todo, found = set(), [(attr(loops[0].attrs, "body").lstrip("%"), False)], []
    while todo:
        name, inside = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for ins in comps[name]:
            if ins.opcode == "while":
                if nested:
                    todo += [(c, True) for c in callees(ins)]
            else:
                todo += [(c, inside) for c in callees(ins)]
            if inside == nested:
                found.append(ins)
    return comps, found


def large_collectives_in_accumulation(hlo: str) -> list[str]:
    """Collectives of >= LARGE result bytes in the accumulation loop's body, not in the loops
    nested in it."""
    _, body = _accumulation_instructions(hlo, nested=False)
    return [f"{ins.opcode} {ins.type[:60]}" for ins in body
            if _is_collective(ins) and shape_bytes(ins.type) >= LARGE]


def data_parallel_reductions_in_layer_scans(hlo: str, mesh) -> list[str]:
    """Reductions (all-reduce, reduce-scatter) inside the loops nested in the accumulation
    loop whose device groups span a data-parallel axis: a weight gradient reduced at every
    layer (the tokens' own reductions, e.g. the MoE's outputs and its metrics, run over the
    expert axis within a group). Partition i is mesh.devices.flat[i]."""
    names = list(mesh.shape)
    coords = np.array(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)).T
    _, inner = _accumulation_instructions(hlo, nested=True)
    found = []
    for ins in inner:
        if not ins.opcode.startswith(("all-reduce", "reduce-scatter")) or \
                ins.opcode.endswith("done"):
            continue
        c = coords[np.asarray(replica_groups(ins.attrs, mesh.devices.size))]
        varies = (c != c[:, :1]).any(axis=(0, 1))
        if any(varies[names.index(a)] for a in DATA_PARALLEL):
            op = re.search(r'op_name="([^"]*)"', attr(ins.attrs, "metadata") or "")
            found.append(f"{ins.opcode} {ins.type[:50]} {op.group(1)[-60:] if op else ''}")
    return found


def expert_reductions_in_layer_scans(hlo: str, mesh) -> list[str]:
    """Reductions (all-reduce, reduce-scatter) of >= SMALL result bytes inside the loops nested
    in the accumulation loop whose device groups span the expert axis, outside the MoE's
    shard_map (where the tokens' own exchanges run over it): a gradient of a weight replicated
    over the expert axis (attention, norms, router, shared experts) reduced at every layer."""
    axis = list(mesh.shape).index("expert")
    coords = np.array(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape)).T
    _, inner = _accumulation_instructions(hlo, nested=True)
    found = []
    for ins in inner:
        if not ins.opcode.startswith(("all-reduce", "reduce-scatter")) or \
                ins.opcode.endswith("done") or shape_bytes(ins.type) < SMALL:
            continue
        op = re.search(r'op_name="([^"]*)"', attr(ins.attrs, "metadata") or "")
        c = coords[np.asarray(replica_groups(ins.attrs, mesh.devices.size))]
        if (c[..., axis] != c[:, :1, axis]).any() and "shard_map" not in (op.group(1) if op
                                                                          else ""):
            found.append(f"{ins.opcode} {ins.type[:50]} {op.group(1)[-60:] if op else ''}")
    return found


LAYOUTS = {"zero3": ["mesh.weights=zero3"], "zero1": ["mesh.weights=zero1"],
           "zero1_pipelined": ["mesh.weights=zero1", *PIPELINED]}


@functools.cache
def compiled(name: str):
    """(HLO text, cross-host bytes per device per step, mesh) of LAYOUTS[name], compiled once
    per process when a test first asks (each test's timeout then covers at most two)."""
    setup, step, _ = compile_step([*TINY, *LAYOUTS[name]], 16, 2, "gpu", "h100")
    hlo, mesh = step.as_text(), setup.trainer.mesh
    return hlo, collective_bytes(hlo, mesh, 8).total("dcn"), mesh


def test_zero1_accumulates_without_moving_weights():
    assert large_collectives_in_accumulation(compiled("zero3")[0])  # the check can fire
    assert large_collectives_in_accumulation(compiled("zero1")[0]) == []


@pytest.mark.parametrize("name", ["zero1", "zero1_pipelined"])
@pytest.mark.parametrize("reductions", [data_parallel_reductions_in_layer_scans,
                                        expert_reductions_in_layer_scans],
                         ids=["over_data_parallel_axes", "over_the_expert_axis"])
def test_zero1_layer_scans_reduce_no_gradient(reductions, name):
    """Under zero1 the loops nested in the accumulation loop (the layer scans) reduce no weight
    gradient over the data-parallel axes, nor over `expert` outside the MoE shard_map; zero3's
    do, so each check can fire."""
    hlo, _, mesh = compiled("zero3")
    assert reductions(hlo, mesh)  # the check can fire
    hlo, _, mesh = compiled(name)
    assert reductions(hlo, mesh) == []


def test_zero1_sends_fewer_bytes_across_hosts():
    assert compiled("zero1")[1] < compiled("zero3")[1]
