"""Shared test fixtures: a small config, random packed batches, loss and grads on a mesh."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from maxmoe.config_files import load_config
from maxmoe.model.transformer import build_model
from maxmoe.sharding import make_mesh, named, state_shardings, use_mesh
from maxmoe.validation import dcn_sizes, validate

SMALL = [
    "model.vocab_size=256", "model.hidden_size=64", "model.num_layers=3", "model.num_dense_layers=1",
    "model.dense_mlp_size=128", "attention.num_heads=4", "attention.num_kv_heads=2",
    "attention.head_dim=16", "moe.num_experts=8", "moe.experts_per_token=2",
    "moe.expert_mlp_size=32", "moe.num_shared_experts=1", "data.seq_len=32",
    "data.global_batch_size=16", "precision.compute_dtype=float32", "mesh.data=-1",
]


def small_config(*overrides: str):
    cfg, origins = load_config([], SMALL + list(overrides))
    return cfg, origins


def random_batch(cfg, seed: int = 0, docs_per_row: int = 3,
                 distinct_neighbours: bool = False) -> dict[str, np.ndarray]:
    """Rows of several packed documents of random lengths, with a padded tail.

    distinct_neighbours: no token equals the one before it. A document (or the padding) that
    opens with a repeated token gives both positions the same hidden state (attention averages
    equal values), so their router weights tie exactly, and a ranking by router weight (the
    probability drop policy) then orders them by float32 rounding, which differs per layout."""
    rng = np.random.default_rng(seed)
    b, s = cfg.data.global_batch_size, cfg.data.seq_len
    segment_ids = np.zeros((b, s), np.int32)
    positions = np.zeros((b, s), np.int32)
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s - 2), docs_per_row - 1, replace=False))
        bounds = [0, *cuts, s - 2]  # the last two tokens are padding
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            segment_ids[r, lo:hi] = i + 1
            positions[r, lo:hi] = np.arange(hi - lo)
    tokens = rng.integers(1, cfg.model.vocab_size, (b, s)).astype(np.int32)
    for j in range(1, s) if distinct_neighbours else ():  # the next id up, wrapping past 0
        repeat = tokens[:, j] == tokens[:, j - 1]
        tokens[repeat, j] = tokens[repeat, j] % (cfg.model.vocab_size - 1) + 1
    targets = np.where(segment_ids > 0, rng.integers(1, cfg.model.vocab_size, (b, s)), 0)
    return dict(tokens=tokens, targets=targets.astype(np.int32), segment_ids=segment_ids,
                positions=positions, loss_mask=(segment_ids > 0).astype(np.float32))


def loss_and_grads(cfg, origins, batch, num_devices: int, edit=None):
    """First-step loss, metrics and gradients on a mesh over the first num_devices devices.
    edit(params) -> params, if given, changes the initial state (a pure dict) before placement."""
    sizes = validate(cfg, num_devices, origins)
    mesh = make_mesh(sizes, jax.devices()[:num_devices], dcn=dcn_sizes(cfg))
    graphdef, variables = nnx.split(build_model(cfg, cfg.train.seed))
    params = nnx.to_pure_dict(variables)
    params = params if edit is None else edit(params)
    shardings = nnx.to_pure_dict(state_shardings(variables, mesh, cfg.mesh.rules))

    def loss_fn(p, b):
        return nnx.merge(graphdef, p).loss(b)

    with use_mesh(mesh, cfg.mesh.rules):
        params = jax.device_put(params, shardings)
        batch = jax.device_put(batch, named(("batch", "seq")))
        (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, batch)
    return jax.device_get((loss, metrics, grads))


def stacked(params):
    """scan_layers=false keeps each layer's params apart (layer_groups/<g>/<layer>/...):
    stacked here into the scanned layout (layer_groups/<g>/...[L]) to compare the two."""
    groups = params["layer_groups"]
    return dict(params, layer_groups={
        g: jax.tree.map(lambda *a: np.stack(a), *[t[j] for j in sorted(t)])
        if all(isinstance(j, int) for j in t) else t for g, t in groups.items()})


def per_layer(params):
    """The inverse of stacked: layer_groups/<g>/...[L] -> layer_groups/<g>/<layer>/..."""
    return dict(params, layer_groups={
        g: {j: jax.tree.map(lambda a, j=j: a[j], t) for j in range(len(jax.tree.leaves(t)[0]))}
        for g, t in params["layer_groups"].items()})


def assert_grads_close(grads, ref_grads, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Every gradient leaf equals the reference's within rtol / atol (the equivalence matrix's
    float32 tolerance by default), the failing leaf named by its path."""
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    flat = jax.tree.leaves(grads)
    assert len(flat) == len(flat_ref)
    for (path, g_ref), g in zip(flat_ref, flat, strict=True):
        np.testing.assert_allclose(g, g_ref, rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))
