"""LeafReader: every param leaf assembled from random slices equals from_hf.read_hf's (bit for
bit, on every committed fixture, stacked and per-layer, sharded + FP8 + MTP), and a slice reads
only the hub tensors it covers."""

import dataclasses

import jax
import numpy as np
import pytest

from maxmoe.convert.from_hf import read_hf
from maxmoe.hf.names import get_path
from maxmoe.hf.safetensors_io import ConversionError, SafetensorsReader, dequantize_fp8
from maxmoe.hf.slices import LeafReader, dequantize_fp8_block
from tests.convert.test_convert import (
    DEEPSEEK,
    FIXTURES,
    make_hub_checkpoint_with_mtp_fp8_and_shards,
    quantize_fp8,
)
from tests.helpers import per_layer


def random_cuts(rng, n: int) -> list[slice]:
    """A random partition of range(n) into contiguous slices (at least one)."""
    inner = sorted(rng.choice(np.arange(1, n), rng.integers(0, min(3, n - 1) + 1),
                              replace=False).tolist()) if n > 1 else []
    bounds = [0, *inner, n]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def assemble(reader: LeafReader, path: tuple, shape: tuple, rng) -> np.ndarray:
    """The leaf from a random grid of slices, each read alone."""
    out = np.full(shape, np.nan, np.float32)
    grid = [random_cuts(rng, n) for n in shape]
    for box in np.ndindex(*[len(g) for g in grid]):
        index = tuple(g[i] for g, i in zip(grid, box, strict=True))
        block = reader.read(path, index)
        assert block.dtype == np.float32 and block.shape == out[index].shape, path
        out[index] = block
    return out


def assert_leaves_equal(reader: LeafReader, params: dict, seed: int = 0):
    rng = np.random.default_rng(seed)
    shapes = reader.shapes()
    assert len(shapes) == len(jax.tree.leaves(params))
    for path, shape in shapes.items():
        want = get_path(params, path)
        assert tuple(want.shape) == shape, path
        np.testing.assert_array_equal(assemble(reader, path, shape, rng), want, err_msg=str(path))


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.iterdir()))
def test_slices_assemble_to_read_hf_params(name):
    cfg, params, _, _ = read_hf(FIXTURES / name)
    reader = LeafReader(FIXTURES / name)
    assert reader.cfg == cfg
    assert_leaves_equal(reader, params)


def test_per_layer_layout_and_whole_leaf_reads():
    """model.scan_layers=false: the per-layer leaves (layer_groups/<g>/<layer>/...) are the
    stacked ones split; an empty index reads the whole leaf."""
    cfg, params, _, _ = read_hf(DEEPSEEK)
    split_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=False))
    reader = LeafReader(DEEPSEEK, split_cfg)
    assert_leaves_equal(reader, per_layer(params), seed=1)
    path = ("layer_groups", 1, 0, "mlp", "gate")
    np.testing.assert_array_equal(reader.read(path), get_path(per_layer(params), path))


def test_sharded_fp8_checkpoint_with_mtp(tmp_path):
    """Two shards with an index, one FP8 weight (dequantised on the slice's 128-blocks alone:
    the same float32 products as dequantizing it whole), an MTP layer; with mtp_depth=0 the
    MTP tensors are dropped and the rest reads the same."""
    make_hub_checkpoint_with_mtp_fp8_and_shards(DEEPSEEK, tmp_path / "hub")
    cfg, params, _, _ = read_hf(tmp_path / "hub")
    reader = LeafReader(tmp_path / "hub")
    assert reader.cfg.model.mtp_depth == 1
    assert_leaves_equal(reader, params, seed=2)
    no_mtp = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp_depth=0))
    reader = LeafReader(tmp_path / "hub", no_mtp)
    del params["mtp"]
    assert_leaves_equal(reader, params, seed=3)


def test_a_slice_reads_only_the_tensors_it_covers(monkeypatch):
    """Experts [1, 3) of MoE layer 2 (stacked index 1 of group 1): their gate_proj tensors only,
    and of the embedding rows [5, 9) only those rows."""
    reader = LeafReader(DEEPSEEK)
    touched: list[tuple[str, object]] = []
    raw = SafetensorsReader.raw

    class Spy:
        def __init__(self, name, value):
            self.name, self.value = name, value

        def __getitem__(self, index):
            touched.append((self.name, index))
            return self.value[index]

        def reshape(self, *shape):
            return Spy(self.name, self.value.reshape(*shape))

    monkeypatch.setattr(SafetensorsReader, "raw", lambda self, name: Spy(name, raw(self, name)))
    reader.read(("layer_groups", 1, "mlp", "gate"), (slice(1, 2), slice(1, 3)))
    assert sorted({n for n, _ in touched}) == [
        f"model.layers.2.mlp.experts.{e}.gate_proj.weight" for e in (1, 2)]
    touched.clear()
    block = reader.read(("embed", "embedding"), (slice(5, 9),))
    assert [n for n, _ in touched] == ["model.embed_tokens.weight"]
    assert touched[0][1][0] == slice(5, 9)  # a row slice of the memory map, not the tensor
    assert block.shape == (4, reader.shapes()[("embed", "embedding")][1])


def test_missing_tensor_and_wrong_config_are_errors():
    cfg, _, _, _ = read_hf(DEEPSEEK)
    more_experts = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=32))
    with pytest.raises(ConversionError, match="missing tensor 'model.layers.1.mlp.experts.16"):
        LeafReader(DEEPSEEK, more_experts)
    wider = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_mlp_size=16))
    with pytest.raises(ConversionError, match="has shape"):
        LeafReader(DEEPSEEK, wider)


def test_fp8_slices_across_blocks_equal_the_whole_dequantisation():
    """A 300x200 FP8 weight (3x2 scale blocks, ragged edges): any row/column selection
    dequantises to the same float32 values as dequantize_fp8 of the whole weight."""
    rng = np.random.default_rng(4)
    q, scale = quantize_fp8(rng.normal(size=(300, 200)).astype(np.float32))
    whole = dequantize_fp8(q, scale)
    for rows, cols in [(np.arange(100, 260), np.arange(0, 200)),
                       (np.array([0, 127, 128, 299]), np.array([5, 128, 199]))]:
        got = dequantize_fp8_block(q[rows][:, cols], scale, rows, cols)
        np.testing.assert_array_equal(got, whole[np.ix_(rows, cols)])
