"""Conversion: HF -> maxmoe -> HF is bit-identical per tensor (single file and sharded, MTP
layers included); FP8 block-scaled weights dequantize like a float64 NumPy reference; unknown or
missing tensors are one-line errors with exit code 2; the CLI round trip reproduces HF logits;
neither direction holds the model twice."""

import dataclasses
import json
import shutil
import tracemalloc
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import maxmoe.convert.to_hf
from maxmoe.cli import main
from maxmoe.config_files import load_config
from maxmoe.convert.checkpoint_io import read_params
from maxmoe.convert.from_hf import convert_from_hf, read_hf
from maxmoe.convert.to_hf import convert_to_hf
from maxmoe.hf import names
from maxmoe.hf.config import family_for
from maxmoe.hf.names import get_path
from maxmoe.hf.safetensors_io import SafetensorsReader, dequantize_fp8
from maxmoe.model.transformer import abstract_params
from tests.helpers import per_layer

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
DEEPSEEK = FIXTURES / "deepseek_v3_qlora_interleave_yarn"  # layers: 0 dense, 1-2 MoE


def hub_tensors(directory: Path) -> dict[str, np.ndarray]:
    reader = SafetensorsReader(directory)
    return {n: np.array(reader.raw(n)) for n in reader.names()}


def assert_bit_identical(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert got[name].shape == value.shape, name
        assert got[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.iterdir()))
def test_round_trip_is_bit_identical(tmp_path, name):
    convert_from_hf(FIXTURES / name, tmp_path / "maxmoe")
    convert_to_hf(tmp_path / "maxmoe", tmp_path / "hf")
    # read back with the reference library: what we write is plain safetensors
    assert_bit_identical(load_file(tmp_path / "hf" / "model.safetensors"), hub_tensors(FIXTURES / name))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == json.loads((FIXTURES / name / "config.json").read_text())["model_type"]


def test_per_layer_params_give_the_same_hub_tensors():
    """model.scan_layers=false keeps each layer's params apart (layer_groups/<g>/<layer>/...,
    the layout a run with it trains and exports): the tensor map finds them there and exports
    the same bytes as from the stacked layout that the round trip above checks against HF."""
    cfg, params, _, _ = read_hf(DEEPSEEK)
    per_layer_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model,
                                                                       scan_layers=False))
    split = per_layer(params)
    assert jax.tree.structure(split) == jax.tree.structure(abstract_params(per_layer_cfg))
    family = family_for(cfg)
    stacked = {t.name: names.params_to_hub(t, params) for t in names.hub_tensors(cfg, family)}
    got = {t.name: names.params_to_hub(t, split)
           for t in names.hub_tensors(per_layer_cfg, family)}
    assert_bit_identical(got, stacked)
    assert any(".layers.2.mlp.experts." in name for name in got)


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3 hub format: E4M3 values and one float32 scale_inv per 128x128 block."""
    rows, cols = w.shape
    br, bc = -(-rows // 128), -(-cols // 128)
    scale = np.zeros((br, bc), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale[i, j] = max(np.abs(block).max(), 1e-12) / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (block / scale[i, j]).astype(q.dtype)
    return q, scale


def test_fp8_dequantization_matches_float64_reference():
    w = np.random.default_rng(0).normal(size=(300, 200)).astype(np.float32)
    q, scale = quantize_fp8(w)
    ref = q.astype(np.float64) * np.kron(scale.astype(np.float64), np.ones((128, 128)))[:300, :200]
    got = dequantize_fp8(q, scale)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-7, atol=0)
    np.testing.assert_allclose(got, w, rtol=0.07, atol=0.07 * np.abs(w).max())  # E4M3: 3 bits


def make_hub_checkpoint_with_mtp_fp8_and_shards(src: Path, dst: Path) -> tuple[dict, str]:
    """The fixture as DeepSeek-V3 hub files: an MTP layer 3 (a copy of MoE layer 2 + the MTP
    tensors), one FP8 weight with its scale, split over two shards with an index."""
    tensors = hub_tensors(src)
    rng = np.random.default_rng(1)
    d = tensors["model.norm.weight"].shape[0]
    for name, value in list(tensors.items()):
        if name.startswith("model.layers.2."):
            tensors[name.replace("layers.2.", "layers.3.")] = value.copy()
    tensors.update({
        "model.layers.3.enorm.weight": rng.normal(size=d).astype(np.float32),
        "model.layers.3.hnorm.weight": rng.normal(size=d).astype(np.float32),
        "model.layers.3.eh_proj.weight": rng.normal(size=(d, 2 * d)).astype(np.float32),
        "model.layers.3.shared_head.norm.weight": rng.normal(size=d).astype(np.float32),
        "model.layers.3.embed_tokens.weight": tensors["model.embed_tokens.weight"].copy(),
        "model.layers.3.shared_head.head.weight": tensors["lm_head.weight"].copy(),
    })
    fp8 = "model.layers.1.self_attn.q_b_proj.weight"
    tensors[fp8], tensors[fp8 + "_scale_inv"] = quantize_fp8(tensors[fp8])
    dst.mkdir()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part if tensors[n].dtype != ml_dtypes.float8_e4m3fn},
                  dst / file)
    # the safetensors numpy binding cannot write float8: patch the FP8 tensor in by hand
    _write_with_fp8(dst, shards, tensors)
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config))
    return tensors, fp8


def _write_with_fp8(dst: Path, shards: dict, tensors: dict):
    for file, part in shards.items():
        header, blobs, offset = {}, [], 0
        for n in part:
            value = np.ascontiguousarray(tensors[n])
            dtype = {np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.float32): "F32"}[value.dtype]
            header[n] = {"dtype": dtype, "shape": list(value.shape),
                         "data_offsets": [offset, offset + value.nbytes]}
            blobs.append(value.tobytes())
            offset += value.nbytes
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        (dst / file).write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def test_sharded_fp8_checkpoint_with_mtp_round_trips(tmp_path):
    tensors, fp8 = make_hub_checkpoint_with_mtp_fp8_and_shards(DEEPSEEK, tmp_path / "hub")
    cfg, params, _, _ = read_hf(tmp_path / "hub")
    assert cfg.model.mtp_depth == 1
    # the FP8 weight arrives dequantized (q_b kernel of MoE layer 1 = group 1, index 0)
    q_b = get_path(params, ("layer_groups", 1, "attn", "q_b"))[0]
    want = dequantize_fp8(tensors[fp8], tensors[fp8 + "_scale_inv"])
    np.testing.assert_array_equal(q_b.reshape(q_b.shape[0], -1), want.T)
    np.testing.assert_array_equal(get_path(params, ("mtp", 0, "projection")),
                                  tensors["model.layers.3.eh_proj.weight"].T)

    convert_from_hf(tmp_path / "hub", tmp_path / "maxmoe")
    convert_to_hf(tmp_path / "maxmoe", tmp_path / "out", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    written = hub_tensors(tmp_path / "out")
    # FP8 weights come back dequantized in bfloat16 (as DeepSeek's own fp8 -> bf16 cast)
    dequantized = written.pop(fp8)
    assert dequantized.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(dequantized, want.astype(ml_dtypes.bfloat16))
    del tensors[fp8], tensors[fp8 + "_scale_inv"]
    assert_bit_identical(written, tensors)


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err.strip()


def test_unknown_tensor_is_a_one_line_error(tmp_path, capsys):
    shutil.copytree(DEEPSEEK, tmp_path / "hub")
    tensors = load_file(tmp_path / "hub" / "model.safetensors")
    tensors["model.layers.1.mlp.experts.99.gate_proj.weight"] = np.zeros((8, 16), np.float32)
    save_file(tensors, tmp_path / "hub" / "model.safetensors")
    code, err = run_cli(capsys, "convert", "from-hf", str(tmp_path / "hub"), str(tmp_path / "out"))
    assert code == 2 and len(err.splitlines()) == 1
    assert "unknown tensor 'model.layers.1.mlp.experts.99.gate_proj.weight'" in err
    assert not (tmp_path / "out").exists()


def test_missing_tensor_is_a_one_line_error(tmp_path, capsys):
    shutil.copytree(DEEPSEEK, tmp_path / "hub")
    tensors = load_file(tmp_path / "hub" / "model.safetensors")
    del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
    save_file(tensors, tmp_path / "hub" / "model.safetensors")
    code, err = run_cli(capsys, "convert", "from-hf", str(tmp_path / "hub"), str(tmp_path / "out"))
    assert code == 2 and len(err.splitlines()) == 1
    assert "missing tensor 'model.layers.2.self_attn.kv_b_proj.weight'" in err


def test_cli_convert_then_forward_reproduces_hf_logits(tmp_path, capsys):
    name = FIXTURES / "qwen3_moe_sparse_step"
    assert run_cli(capsys, "convert", "from-hf", str(name), str(tmp_path / "ckpt"))[0] == 0
    code, _ = run_cli(capsys, "forward", str(tmp_path / "ckpt"), "--input",
                      str(name / "input_ids.npy"), "--output", str(tmp_path / "logits.npy"))
    assert code == 0
    logits = np.load(tmp_path / "logits.npy")
    assert logits.dtype == np.float32
    assert np.max(np.abs(logits - np.load(name / "logits.npy"))) < 1e-4
    assert run_cli(capsys, "convert", "to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"))[0] == 0
    assert_bit_identical(hub_tensors(tmp_path / "hf"), hub_tensors(name))


def test_conversion_never_holds_the_model_twice(tmp_path, monkeypatch):
    """from-hf fills the float32 params once and saves them in place (Orbax's default numpy
    handler deep-copies every array: 2x); to-hf restores one param group at a time."""
    # imported before measuring, or its import counts as allocations
    import orbax.checkpoint  # noqa: F401

    from tools.make_random_hf_checkpoint import write_random_checkpoint

    cfg, _ = load_config([str(ROOT / "configs" / "models" / "tiny_deepseek_v3.yaml")],
                         ["model.vocab_size=4096", "moe.num_experts=16"])
    write_random_checkpoint(cfg, tmp_path / "hub", 2**20)
    model_bytes = sum(x.size * 4 for x in jax.tree.leaves(abstract_params(cfg)))  # 12.5 MB
    tracemalloc.start()  # numpy reports its arrays; tensorstore's buffers are not seen
    try:
        convert_from_hf(tmp_path / "hub", tmp_path / "maxmoe")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * model_bytes

    restored = []

    def restore_and_count(*args):
        params = read_params(*args)
        restored.append(sum(x.nbytes for x in jax.tree.leaves(params)))
        return params

    monkeypatch.setattr(maxmoe.convert.to_hf, "read_params", restore_and_count)
    convert_to_hf(tmp_path / "maxmoe", tmp_path / "hf", max_shard_bytes=2**20)
    assert sum(restored) == model_bytes and max(restored) < model_bytes / 4
    assert_bit_identical(hub_tensors(tmp_path / "hf"), hub_tensors(tmp_path / "hub"))
