"""Checkpoint checksums (train/checksums.py): chunks are global regions hashed once per job,
they verify after a restore onto another mesh and from any share of processes, a flipped byte
inside an array's saved data is caught (and, without checksums, restores silently), and
`maxmoe ckpt verify` reports it with its exit codes. On the 8 fake CPU devices from conftest."""

import dataclasses
import json
from pathlib import Path

import crc32c
import jax
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import SingleDeviceSharding

from maxmoe.cli import main
from maxmoe.config import CheckpointConfig
from maxmoe.config_files import load_config
from maxmoe.sharding import make_mesh
from maxmoe.train import checksums
from maxmoe.train.checkpoint import Checkpointer, abstract_like
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate
from tests.train.test_chaos import TINY
from tests.train.test_checkpoint import make_state, mesh

EMBEDDING = "params.embed.embedding"  # the array the chaos tests flip a byte of


def flip_byte(step_dir: Path, array: str, chunk: str = "0.0") -> Path:
    """Flips the lowest bit of the middle byte of one saved chunk of `array`, in the OCDBT data
    file under `<step_dir>/state/` that holds it (found by its stored bytes, so the flip lands
    inside that array's data and nowhere else); returns the file."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{step_dir / 'state'}/"}).result()
    stored = kv.read(f"{array}/{chunk}".encode()).result().value
    assert len(stored) > 64, f"{array}/{chunk}: only {len(stored)} bytes stored"
    for file in sorted((step_dir / "state").rglob("d/*")):
        data = bytearray(file.read_bytes())
        at = data.find(stored)
        if at >= 0:
            data[at + len(stored) // 2] ^= 0x01
            file.write_bytes(bytes(data))
            return file
    raise AssertionError(f"the stored bytes of {array}/{chunk} are in no data file")


def test_regions_cut_the_first_long_axis_into_equal_pieces():
    index = (slice(0, 1), slice(8, 16), slice(None))
    assert checksums.regions(index, (4, 16, 3), 4, max_bytes=10**6) == [((0, 1), (8, 16), (0, 3))]
    assert checksums.regions(index, (4, 16, 3), 4, max_bytes=40) == [
        ((0, 1), (8, 11), (0, 3)), ((0, 1), (11, 14), (0, 3)), ((0, 1), (14, 16), (0, 3))]
    assert checksums.regions((), (), 4, max_bytes=1) == [()]


def test_chunks_are_global_regions_hashed_once_each(tmp_path):
    """Every element of every array is in exactly one recorded chunk (replicas hashed once),
    and each crc is that of the GLOBAL array's region."""
    state = make_state(mesh((2, 4)))
    recorded = checksums.compute(state)["arrays"]
    host = {checksums.array_name(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    assert sorted(recorded) == sorted(host) == ["opt.mu", "params.dense.bias",
                                                "params.dense.kernel", "step"]
    for name, entry in recorded.items():
        value = host[name]
        covered = np.zeros(value.shape, np.int32)
        for region, crc in entry["chunks"]:
            index = tuple(slice(a, b) for a, b in region)
            covered[index] += 1
            assert crc == crc32c.crc32c(np.ascontiguousarray(value[index]).view(np.uint8)
                                        .reshape(-1)), (name, region)
        assert (covered == 1).all(), name
        assert entry["shape"] == list(value.shape) and entry["dtype"] == str(value.dtype)
    assert len(recorded["params.dense.kernel"]["chunks"]) == 8  # P("a", "b"): one per device
    assert len(recorded["params.dense.bias"]["chunks"]) == 4  # P("b"): replicas hashed once


def test_checksums_verify_after_restore_onto_another_mesh_and_over_any_processes(tmp_path):
    state = make_state(mesh((2, 4)))
    with Checkpointer(tmp_path / "ckpt", CheckpointConfig(every_steps=1)) as ckpt:
        ckpt.save(1, state)
        ckpt.wait()
        for target in (mesh((4, 2)), mesh((8, 1))):
            other = make_state(target)
            restored, _ = ckpt.restore(abstract_like(other))  # checks the checksums first
            np.testing.assert_array_equal(restored["params"]["dense"]["kernel"],
                                          state["params"]["dense"]["kernel"])
        one = SingleDeviceSharding(jax.devices()[0])
        ckpt.restore(abstract_like(state, one))
    step = tmp_path / "ckpt" / "1"
    recorded = checksums.read(step / checksums.ITEM)
    total = sum(len(e["chunks"]) for e in recorded.values())
    for count in (1, 3):  # a verify spread over `count` processes reads every chunk once
        shares = [checksums.verify(step / "state", recorded, i, count) for i in range(count)]
        assert all(bad == [] for bad, _ in shares)
        assert sum(n for _, n in shares) == sum(
            np.asarray(x).nbytes for x in jax.tree.leaves(state))
    assert total == 8 + 4 + 4 + 1
    assert checksums.check_step(step) is None


@pytest.fixture(scope="module")
def tiny_state():
    """A real train state of the chaos tests' tiny model (1 device), and its trainer."""
    cfg, origins = load_config([], TINY)
    trainer = make_trainer(cfg, make_mesh(validate(cfg, 1, origins), jax.devices()[:1]))
    return cfg, trainer, trainer.init()


def _two_steps(directory: Path, cfg, state) -> np.ndarray:
    """Steps 2 and 4 of `state`, step 4 with a distinct embedding (so the two are told apart);
    returns step 4's embedding."""
    later = dict(state, params=dict(state["params"], embed=dict(
        state["params"]["embed"], embedding=state["params"]["embed"]["embedding"] + 1.0)))
    with Checkpointer(directory, cfg.checkpoint) as ckpt:
        ckpt.save(2, state)
        ckpt.save(4, later)
    return np.asarray(later["params"]["embed"]["embedding"])


def test_chaos_byte_flip_restores_silently_without_checksums_and_is_caught_with_them(
        tmp_path, tiny_state):
    """A flipped bit in the middle of the embedding's stored chunk of the newest step.
    checkpoint.checksums=false: the step restores without any error, with changed values.
    checkpoint.checksums=true: the step is quarantined, the previous one is restored, and the
    one reason line names the array and its chunk."""
    cfg, trainer, state = tiny_state
    for checks in (False, True):
        directory = tmp_path / f"checksums_{checks}" / "checkpoints"
        saved = _two_steps(directory, cfg, state)
        flip_byte(directory / "4", EMBEDDING)
        ckpt_cfg = dataclasses.replace(cfg.checkpoint, checksums=checks)
        with Checkpointer(directory, ckpt_cfg) as ckpt:
            resumed = ckpt.resume(trainer.abstract_state)
        embedding = np.asarray(resumed.state["params"]["embed"]["embedding"])
        if not checks:  # silent: no error, the newest step, some values changed
            assert resumed.step == 4 and resumed.quarantined == []
            changed = np.argwhere(embedding != saved)
            assert 1 <= len(changed) < 64, changed
        else:
            assert resumed.step == 2
            assert resumed.quarantined == [directory.with_name("checkpoints.quarantine") / "4"]
            [reason] = resumed.reasons
            assert reason.startswith(f"ChecksumError: array {EMBEDDING} chunk [0:512, 0:64]: "
                                     "crc32c "), reason
            np.testing.assert_array_equal(embedding, state["params"]["embed"]["embedding"])


def test_ckpt_verify_exit_codes_and_lines(tmp_path, tiny_state, capsys):
    cfg, _, state = tiny_state
    run = tmp_path / "run"
    with Checkpointer(run / "checkpoints", dataclasses.replace(cfg.checkpoint,
                                                               checksums=False)) as ckpt:
        ckpt.save(1, state, force=True)  # as saved before checksums existed
    _two_steps(run / "checkpoints", cfg, state)
    assert main(["ckpt", "verify", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{run / 'checkpoints' / '1'}: saved without checksums (before maxmoe " \
                     "wrote them, or with checkpoint.checksums=false): not checked"
    assert out[1].startswith(f"{run / 'checkpoints' / '2'}: ok, 86 arrays, 86 chunks, ")
    assert len(out) == 3 and out[2].startswith(f"{run / 'checkpoints' / '4'}: ok")

    flip_byte(run / "checkpoints" / "4", EMBEDDING)
    assert main(["ckpt", "verify", str(run / "checkpoints" / "4")]) == 1
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert out[0] == f"{run / 'checkpoints' / '4'}: BAD, 1 of 86 chunks"
    assert out[1].startswith(f"  array {EMBEDDING} chunk [0:512, 0:64]: crc32c "), out
    assert len(out) == 2 and "1 of 1 checkpoints have bad arrays" in captured.err
    assert main(["ckpt", "verify", str(run)]) == 1  # the run: steps 1, 2 fine, 4 bad
    assert capsys.readouterr().out.count("BAD") == 1

    assert main(["ckpt", "verify", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("maxmoe: error: ") and "no checkpoint" in err[0]


def test_checksum_files_of_every_process_are_merged_and_a_missing_one_is_an_error(tmp_path):
    parts = [{"algorithm": "crc32c", "arrays": {"w": {"shape": [4], "dtype": "float32",
                                                      "chunks": [[[[2 * i, 2 * i + 2]], i]]}}}
             for i in range(2)]
    for i, part in enumerate(parts):
        checksums.write(tmp_path / "sums", part, i, 2)
    merged = checksums.read(tmp_path / "sums")
    assert merged == {"w": {"shape": [4], "dtype": "float32",
                            "chunks": [[[[0, 2]], 0], [[[2, 4]], 1]]}}
    (tmp_path / "sums" / "process_1-of-2.json").unlink()
    with pytest.raises(ValueError, match="missing: process_1-of-2.json"):
        checksums.read(tmp_path / "sums")
    assert json.loads((tmp_path / "sums" / "process_0-of-2.json").read_text())[
        "process_count"] == 2
    assert checksums.read(tmp_path / "absent") is None
