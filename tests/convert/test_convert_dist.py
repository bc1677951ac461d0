"""Streamed, distributed `convert from-hf` (convert/param_writer.py): chunks fit their bound and
cover each leaf once; the directory is Orbax's own non-OCDBT layout (same _METADATA and zarr
metadata as Orbax writes, chunk shapes aside) and restores exactly through the ordinary
restore; FP8 + MTP + sharded hub checkpoints convert in small chunks to what read_hf reads;
two processes each write part of the chunks and the result restores equal to one process's;
peak RSS stays about one tensor + a few chunks above the fixed cost (main: the whole model)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from maxmoe.cli import main
from maxmoe.config_files import load_config
from maxmoe.convert.checkpoint_io import read_params
from maxmoe.convert.from_hf import convert_from_hf, read_hf
from maxmoe.convert.param_writer import (
    Chunk,
    array_name,
    assign,
    chunk_shape,
    leaf_chunks,
    save_streamed,
)
from maxmoe.hf.names import get_path
from maxmoe.hf.safetensors_io import ConversionError, SafetensorsReader
from maxmoe.model.transformer import abstract_params
from maxmoe.train import checksums
from tests.convert.test_convert import DEEPSEEK, make_hub_checkpoint_with_mtp_fp8_and_shards
from tests.distributed.test_multiprocess import free_port
from tools.convert_rss import convert_rss, fixed_rss, largest_tensor
from tools.make_random_hf_checkpoint import write_random_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def leaves(tree) -> dict[tuple, np.ndarray]:
    return {tuple(k.key for k in p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_trees_equal(got, want):
    got, want = leaves(got), leaves(want)
    assert [tuple(map(str, k)) for k in got] == [tuple(map(str, k)) for k in want]
    for (path, a), b in zip(got.items(), want.values(), strict=True):
        assert a.dtype == np.float32 and a.shape == b.shape, path
        np.testing.assert_array_equal(a, b, err_msg=str(path))  # exact: a float32 copy


@pytest.mark.parametrize("shape, order, max_bytes, want", [
    ((10, 4), None, 32, (2, 4)),  # rows of 16 bytes: 2 fit
    ((10, 4), None, 96, (5, 4)),  # 6 rows fit, but 2 pieces of 5 are as few and even
    ((4, 10), (1, 0), 32, (4, 2)),  # cut the last axis first: 4 x 2 x 4 bytes
    ((3, 5, 100), None, 400, (1, 1, 100)),  # axes before the one that fits go to 1
    ((3, 100), None, 16, (1, 4)),  # down to single elements if need be
    ((3, 4), None, 1000, (3, 4)),
    ((), None, 1, ()),
])
def test_chunk_shape(shape, order, max_bytes, want):
    assert chunk_shape(shape, 4, max_bytes, order) == want


def test_leaf_chunks_tile_the_leaf_once():
    seen = np.zeros((7, 3, 5), np.int32)
    for c in leaf_chunks(("x",), (7, 3, 5), chunk_shape((7, 3, 5), 4, 4 * 2 * 5, (0, 2, 1))):
        seen[c.index] += 1
        assert c.nbytes == 4 * seen[c.index].size <= 40
    assert (seen == 1).all()


def test_assign_splits_every_chunk_once_and_balances_bytes():
    sizes = np.random.default_rng(0).integers(1, 1000, 200)
    chunks = [Chunk(("x",), (slice(i, i + 1),), int(n)) for i, n in enumerate(sizes)]
    shares = assign(chunks, 3)
    flat = [c for share in shares for c in share]
    assert sorted(c.index[0].start for c in flat) == list(range(200))  # each once
    for share in shares:  # each in the input order
        assert [c.index[0].start for c in share] == sorted(c.index[0].start for c in share)
    loads = [sum(c.nbytes for c in share) for share in shares]
    assert max(loads) - min(loads) <= sizes.max()  # greedy largest-first bound


def orbax_save(directory: Path, params: dict):
    """What save_converted did before: Orbax's PyTreeCheckpointHandler without OCDBT."""
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save(directory, args=ocp.args.PyTreeSave(params))


def test_streamed_save_is_orbax_layout_and_restores_exactly(tmp_path):
    cfg, params, _, _ = read_hf(DEEPSEEK)
    shapes = {p: v.shape for p, v in leaves(params).items()}
    calls = []

    def produce(path, index):
        calls.append((path, index))
        return get_path(params, path)[index]

    orders = {("lm_head",): (1, 0)}
    save_streamed(tmp_path / "ours" / "params", shapes, produce, max_chunk_bytes=1024,
                  orders=orders)
    orbax_save(tmp_path / "orbax" / "params", params)
    ours, theirs = tmp_path / "ours" / "params", tmp_path / "orbax" / "params"
    assert json.loads((ours / "_METADATA").read_text()) == json.loads(
        (theirs / "_METADATA").read_text())
    for path in shapes:  # the zarr metadata Orbax writes, but for the chunk shapes
        a, b = (json.loads((d / array_name(path) / ".zarray").read_text()) for d in (ours, theirs))
        a.pop("chunks"), b.pop("chunks")
        assert a == b, path
    head = json.loads((ours / "lm_head" / ".zarray").read_text())
    assert head["chunks"][0] == head["shape"][0]  # cut along the vocabulary only
    # every element produced once, in chunks of at most 1 KiB (no row here is larger)
    assert sum(int(np.prod([s.stop - s.start for s in i])) for _, i in calls) == sum(
        int(np.prod(s)) for s in shapes.values())
    assert max(4 * np.prod([s.stop - s.start for s in i]) for _, i in calls) <= 1024
    for directory in ("ours", "orbax"):  # the ordinary restore, unchanged
        assert_trees_equal(read_params(tmp_path / directory, cfg), params)
    assert not (tmp_path / "ours" / "params.tmp").exists()
    # every chunk written has its crc32c, and `maxmoe ckpt verify`'s check finds a flipped byte
    report = checksums.verify_item(ours, ours / checksums.CONVERTED_DIR)
    assert report.bad == [] and report.chunks == len(calls) and report.arrays == len(shapes)
    stored = ours / array_name(("lm_head",)) / "0.0"
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0x01
    stored.write_bytes(bytes(data))
    bad = checksums.verify_item(ours, ours / checksums.CONVERTED_DIR).bad
    assert [(m.array, m.region[1][0]) for m in bad] == [("lm_head", 0)], bad


def test_fp8_mtp_sharded_hub_converts_in_small_chunks_like_read_hf(tmp_path):
    make_hub_checkpoint_with_mtp_fp8_and_shards(DEEPSEEK, tmp_path / "hub")
    cfg, params, hf_config, dtypes = read_hf(tmp_path / "hub")
    _, written = convert_from_hf(tmp_path / "hub", tmp_path / "out", max_chunk_bytes=2048)
    assert written.chunks == written.total > len(leaves(params))  # leaves were cut
    assert_trees_equal(read_params(tmp_path / "out", cfg), params)
    assert json.loads((tmp_path / "out" / "hf" / "tensor_dtypes.json").read_text()) == dtypes
    assert json.loads((tmp_path / "out" / "hf" / "config.json").read_text()) == hf_config


def test_mtp_copy_that_differs_in_its_last_block_is_an_error(tmp_path):
    make_hub_checkpoint_with_mtp_fp8_and_shards(DEEPSEEK, tmp_path / "hub")
    name = "model.layers.3.shared_head.head.weight"
    path = SafetensorsReader(tmp_path / "hub").files[name]
    with open(path, "r+b") as f:  # add 1 to the tensor's last float32 (safetensors layout)
        header_bytes = int.from_bytes(f.read(8), "little")
        end = json.loads(f.read(header_bytes))[name]["data_offsets"][1]
        f.seek(8 + header_bytes + end - 4)
        value = np.frombuffer(f.read(4), np.float32)
        f.seek(-4, 1)
        f.write((value + 1).tobytes())
    with pytest.raises(ConversionError, match=f"tensor '{name}' differs"):
        convert_from_hf(tmp_path / "hub", tmp_path / "out", max_chunk_bytes=256)


def test_chunk_size_zero_is_a_one_line_error(tmp_path, capsys):
    code = main(["convert", "from-hf", str(DEEPSEEK), str(tmp_path / "out"), "--chunk-mb", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--chunk-mb 0.0" in err, err
    assert not (tmp_path / "out").exists()


def _cli(hf_dir: Path, out_dir: Path, env: dict, chunk_mb: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "maxmoe.cli", "convert", "from-hf",
                             str(hf_dir), str(out_dir), "--chunk-mb", str(chunk_mb)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


@pytest.mark.slow
def test_two_processes_each_write_part_and_restore_like_one(tmp_path):
    make_hub_checkpoint_with_mtp_fp8_and_shards(DEEPSEEK, tmp_path / "hub")
    cfg, _, _, _ = read_hf(tmp_path / "hub")
    chunk_mb = 2048 / 2**20
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [_cli(tmp_path / "hub", tmp_path / "two", dict(
        env, MAXMOE_COORDINATOR=f"127.0.0.1:{port}", MAXMOE_NUM_PROCESSES="2",
        MAXMOE_PROCESS_ID=str(i)), chunk_mb) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    convert_from_hf(tmp_path / "hub", tmp_path / "one", max_chunk_bytes=2048)
    written = []
    for i, out in enumerate(outs):
        line = next(x for x in out.splitlines() if f"process {i} of 2 wrote" in x)
        written.append([int(w) for w in line.split("wrote ")[1].split(" chunks")[0].split(" of ")])
    (a, total), (b, total_b) = written
    assert a > 0 and b > 0 and a + b == total == total_b, written
    assert_trees_equal(read_params(tmp_path / "two", cfg), read_params(tmp_path / "one", cfg))
    sums = tmp_path / "two" / "params" / checksums.CONVERTED_DIR
    assert sorted(p.name for p in sums.glob("*.json")) == ["process_0-of-2.json",
                                                         "process_1-of-2.json"]
    report = checksums.verify_item(tmp_path / "two" / "params", sums)
    assert report.bad == [] and report.chunks == total
    assert (tmp_path / "two" / "config.yaml").read_text() == (
        tmp_path / "one" / "config.yaml").read_text()


# Bound on what a conversion holds above its fixed cost (imports, abstract model, tensor map):
# a read may touch the pages of a whole hub tensor (memory-mapped pages count in RSS); chunks
# alive at once: the reader's output and its float32 block and transposed copy (3), the write
# in flight (its array and its compressed copy, 2), or the MTP check's two blocks and their
# comparison: 8 covers them with room; 32 MiB for the allocator and TensorStore's threads.
CHUNK_MB = 4
SLACK = 32 * 2**20


@pytest.mark.slow
def test_peak_rss_is_one_tensor_and_a_few_chunks_not_the_model(tmp_path):
    """Converting a random hub checkpoint (tiny_deepseek_v3 widened, 100 MiB shards) with
    --chunk-mb 4: the child's peak RSS above its fixed cost stays under the largest tensor + 8
    chunks + 32 MiB, while the float32 model is over 3x that bound, so a conversion that held
    the whole model fails. Measured RSS, and the whole-model path's:
    docs/performance/checkpoints-and-hugging-face.md."""
    cfg, _ = load_config([str(ROOT / "configs" / "models" / "tiny_deepseek_v3.yaml")], [
        "model.hidden_size=512", "model.vocab_size=16384", "moe.num_experts=16",
        "moe.expert_mlp_size=512", "model.dense_mlp_size=1024"])
    write_random_checkpoint(cfg, tmp_path / "hub", 100 * 2**20)
    _, tensor_bytes, _ = largest_tensor(tmp_path / "hub")
    model_bytes = 4 * sum(x.size for x in jax.tree.leaves(abstract_params(cfg)))
    fixed = fixed_rss(tmp_path / "hub")
    peak = convert_rss(tmp_path / "hub", ROOT, tmp_path / "out", ["--chunk-mb", str(CHUNK_MB)])
    bound = tensor_bytes + 8 * CHUNK_MB * 2**20 + SLACK
    print(f"fixed {fixed / 2**20:.0f} MiB, conversion {(peak - fixed) / 2**20:.0f} MiB above it "
          f"(bound {bound / 2**20:.0f} MiB, float32 model {model_bytes / 2**20:.0f} MiB)")
    assert model_bytes > 3 * bound  # the premise: holding the model would fail
    assert peak - fixed < bound
