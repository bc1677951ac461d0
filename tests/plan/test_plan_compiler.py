"""`maxmoe plan --compiler`: kernels' `auto` choices follow the current mesh's devices, and
`--compiler gpu` fails in one line where it cannot compile (runs under the normal CPU install)."""

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxmoe import sharding
from maxmoe.config import DEFAULT_RULES, MESH_AXES
from maxmoe.kernels import attention
from maxmoe.kernels.grouped_matmul import dropless_local
from maxmoe.sharding import make_mesh, mesh_platform, use_mesh

SIZES = dict(data=2, fsdp=2, expert=2)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "maxmoe.cli", *args], capture_output=True,
                          check=False, text=True, timeout=300)


def _one_error_line(out) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith("maxmoe: error: "), out.stderr
    return lines[0]


def _gpu_mesh():
    """A stand-in for a mesh of deviceless GPUs: only `devices[...].platform` is read."""
    return SimpleNamespace(devices=np.array([SimpleNamespace(platform="gpu")], dtype=object))


def _grouped_matmul_jaxpr(choice: str) -> str:
    t, k, d, f, experts = 16, 2, 8, 16, 4
    x = jnp.ones((t, d), jnp.float32)
    idx = jnp.zeros((t, k), jnp.int32)
    w = jnp.ones((t, k), jnp.float32)
    wg, wd = jnp.ones((experts, d, f)), jnp.ones((experts, f, d))
    fn = lambda x: dropless_local(x, idx, w, wg, wg, wd, 0, grouped_matmul=choice)  # noqa: E731
    return str(jax.make_jaxpr(fn)(x))


def test_auto_grouped_matmul_follows_the_mesh_devices():
    mesh = make_mesh({a: SIZES.get(a, 1) for a in MESH_AXES})
    with use_mesh(mesh, DEFAULT_RULES):
        assert mesh_platform() == "cpu"
        assert "ragged_dot" not in _grouped_matmul_jaxpr("auto")  # blocked on a CPU mesh
        assert "ragged_dot" in _grouped_matmul_jaxpr("ragged_dot")  # the check can see it
    token = sharding._MESH.set(_gpu_mesh())  # the process's devices stay CPUs
    try:
        assert jax.devices()[0].platform == "cpu" and mesh_platform() == "gpu"
        assert "ragged_dot" in _grouped_matmul_jaxpr("auto")
    finally:
        sharding._MESH.reset(token)


def test_fused_attention_picks_cudnn_only_on_a_gpu_mesh(monkeypatch):
    picked = []

    def record(*args, implementation=None, **kwargs):
        picked.append(implementation)
        return args[0]

    monkeypatch.setattr(jax.nn, "dot_product_attention", record)
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    seg = jnp.ones((1, 4), jnp.int32)
    attention.fused_attention(q, q, q, seg)  # no mesh: jax.devices(), CPUs here
    token = sharding._MESH.set(_gpu_mesh())
    try:
        attention.fused_attention(q, q, q, seg)
        q32 = q.astype(jnp.float32)  # cuDNN takes no float32: XLA even on GPUs
        attention.fused_attention(q32, q32, q32, seg)
    finally:
        sharding._MESH.reset(token)
    assert picked == ["xla", "cudnn", "xla"]


def test_gpu_compiler_rejects_kinds_without_a_target():
    line = _one_error_line(_cli("plan", "configs/tiny.yaml", "--cluster", "8xa100",
                                "--compiler", "gpu"))
    assert "'a100' has no gpu_target" in line and "b200, h100, h200, h800" in line, line


def _has_plugin() -> bool:
    return (importlib.util.find_spec("jax_plugins") is not None
            and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None)


@pytest.mark.skipif(_has_plugin(),
                    reason="the CUDA plugin is installed here")
def test_gpu_compiler_without_the_plugin_is_one_line():
    line = _one_error_line(_cli("plan", "configs/tiny.yaml", "--cluster", "8xh200",
                                "--compiler", "gpu"))
    assert 'pip install "jax[cuda12]==' in line


@pytest.mark.parametrize("choice, plugin, cluster, want, says", [
    ("auto", True, "8xh100", "gpu", False),  # NVIDIA with a gpu_target and the plugin: XLA:GPU
    ("auto", True, "8xb200", "gpu", False),
    ("auto", False, "8xh100", "cpu", True),  # no plugin: XLA:CPU stand-ins, said in one line
    ("auto", True, "8xa100", "cpu", True),  # an NVIDIA kind without a gpu_target
    ("auto", True, "8xcpu", "cpu", False),  # XLA:CPU is the real compiler there
    ("cpu", True, "8xh100", "cpu", False),  # an explicit choice is kept
])
def test_compiler_auto_resolves_by_plugin_and_kind(monkeypatch, choice, plugin, cluster, want,
                                                   says):
    import io

    from maxmoe.cluster import load_cluster
    from maxmoe.plan import gpu_aot, planner

    monkeypatch.setattr(gpu_aot, "plugin_installed", lambda: plugin)
    out = io.StringIO()
    assert planner.resolve_compiler(choice, load_cluster(cluster), out) == want
    lines = out.getvalue().splitlines()
    assert len(lines) == int(says), lines
    if says:
        assert "--compiler auto -> cpu" in lines[0] and "XLA:CPU" in lines[0]
        assert "stand-ins" in lines[0]


def test_plan_defaults_to_auto():
    from maxmoe.cli import build_parser

    args = build_parser().parse_args(["plan", "configs/tiny.yaml", "--cluster", "8xh100"])
    assert args.compiler == "auto"
