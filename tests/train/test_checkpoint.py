"""Checkpointer: async save/restore, iterator resume, retention, save cadence, resharding,
crash debris and the missing-checkpoint error, on the 8 fake CPU devices from conftest."""

import logging
import shutil

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from maxmoe.config import CheckpointConfig
from maxmoe.train import checkpoint_handlers
from maxmoe.train.checkpoint import Checkpointer, abstract_like

AUTO = jax.sharding.AxisType.Auto


def mesh(shape):
    return jax.make_mesh(shape, ("a", "b"), axis_types=(AUTO, AUTO))


def make_state(m):
    kernel = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 7.0
    return {
        "params": {"dense": {"kernel": jax.device_put(kernel, NamedSharding(m, P("a", "b"))),
                             "bias": jax.device_put(jnp.ones(16), NamedSharding(m, P("b")))}},
        "opt": {"mu": jax.device_put(kernel.astype(jnp.bfloat16), NamedSharding(m, P(None, "b")))},
        "step": jax.device_put(jnp.int32(7), NamedSharding(m, P())),
    }


def make_iterator():
    return iter(grain.MapDataset.range(100).shuffle(seed=1).to_iter_dataset().batch(4))


def assert_same(restored, expected):
    assert jax.tree.structure(restored) == jax.tree.structure(expected)
    for r, e in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
        assert r.dtype == e.dtype and r.shape == e.shape
        np.testing.assert_array_equal(np.asarray(r), np.asarray(e))


def test_async_save_restores_state_and_iterator(tmp_path):
    """An async save written while the train loop deletes the state and advances the iterator
    restores the state as saved (values and shardings) and the iterator at the saved position
    (its next batches equal those after the save)."""
    state, it = make_state(mesh((2, 4))), make_iterator()
    for _ in range(3):
        next(it)
    values, abstract = jax.tree.map(np.asarray, state), abstract_like(state)
    ckpt = Checkpointer(tmp_path / "ckpt", CheckpointConfig(every_steps=10, async_save=True))
    assert ckpt.save(10, state, it)
    # The train loop donates the state and advances the iterator right after save():
    # neither may change what is written (arrays reach host memory, and the iterator
    # position is read, before save() returns).
    jax.tree.map(lambda x: x.delete(), state)
    expected = [next(it) for _ in range(3)]
    ckpt.wait()
    assert ckpt.latest_step() == 10
    ckpt.close()

    ckpt = Checkpointer(tmp_path / "ckpt", CheckpointConfig(every_steps=10))
    assert_same(ckpt.restore(abstract)[0], values)  # the iterator is optional on restore
    fresh = make_iterator()
    restored, step = ckpt.restore(abstract, fresh)
    ckpt.close()
    assert step == 10
    assert_same(restored, values)
    for r, a in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract), strict=True):
        assert r.sharding == a.sharding
    for e in expected:
        np.testing.assert_array_equal(next(fresh), e)


def test_keeps_only_newest(tmp_path):
    """checkpoint.keep=2 leaves only the 2 newest steps, in the checkpointer's list and on disk."""
    state = make_state(mesh((2, 4)))
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1, keep=2, async_save=False)) as ckpt:
        for step in range(1, 5):
            assert ckpt.save(step, state)
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["3", "4"]


def test_saves_only_multiples_unless_forced(tmp_path):
    state = make_state(mesh((2, 4)))
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=5)) as ckpt:
        assert not ckpt.save(3, state)  # first call too: Orbax's InitialSavePolicy is off
        assert ckpt.save(5, state)
        assert not ckpt.save(7, state)
        assert ckpt.save(7, state, force=True)  # e.g. the last step
        assert not ckpt.save(7, state, force=True)  # exists: skipped, not an error
        assert ckpt.save(10, state)
        ckpt.wait()
        assert ckpt.all_steps() == [5, 7, 10]
    with Checkpointer(tmp_path / "off", CheckpointConfig(every_steps=1, enabled=False)) as ckpt:
        assert not ckpt.save(1, state, force=True)


def test_restore_reshards_onto_another_mesh(tmp_path):
    state = make_state(mesh((2, 4)))
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1)) as ckpt:
        ckpt.save(1, state)  # no wait(): restore must wait for the in-flight save itself
        m42 = mesh((4, 2))
        target = jax.tree.map(lambda x: NamedSharding(m42, x.sharding.spec), state)
        # eval_shape output has no shardings of its own: they come from `target`.
        shapes = jax.eval_shape(lambda: state)
        restored, _ = ckpt.restore(abstract_like(shapes, target))
        assert_same(restored, state)
        for r, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
            assert r.sharding == t
        one = SingleDeviceSharding(jax.devices()[3])
        restored, _ = ckpt.restore(abstract_like(state, one))
        assert_same(restored, state)
        assert all(r.sharding == one for r in jax.tree.leaves(restored))


def test_crash_debris_is_ignored_and_removed(tmp_path):
    state = make_state(mesh((2, 4)))
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=10)) as ckpt:
        ckpt.save(10, state)
    # What kill -9 mid-save leaves: a newer step still under its temporary name.
    shutil.copytree(tmp_path / "10", tmp_path / "20.orbax-checkpoint-tmp-1712345678")
    (tmp_path / "30.orbax-checkpoint-tmp").mkdir()
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=10)) as ckpt:
        assert ckpt.latest_step() == 10
        restored, step = ckpt.restore(abstract_like(state))
        assert step == 10
        assert_same(restored, state)
        assert ckpt.save(20, state)  # the step the crash interrupted saves cleanly
        ckpt.wait()
        assert ckpt.all_steps() == [10, 20]
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    state = make_state(mesh((2, 4)))
    with Checkpointer(tmp_path / "empty", CheckpointConfig()) as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(FileNotFoundError, match="no committed checkpoint in .*available steps: none"):
            ckpt.restore(abstract_like(state))
    with Checkpointer(tmp_path / "some", CheckpointConfig(every_steps=1)) as ckpt:
        ckpt.save(1, state)
        with pytest.raises(FileNotFoundError, match=r"step 2 .*available steps: \[1\]"):
            ckpt.restore(abstract_like(state), step=2)
        with pytest.raises(ValueError, match="no data iterator state"):
            ckpt.restore(abstract_like(state), make_iterator())


def test_corrupt_latest_is_moved_aside_and_the_previous_step_resumes(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="maxmoe.train.checkpoint")
    state, abstract = make_state(mesh((2, 4))), None
    abstract = abstract_like(state)
    with Checkpointer(tmp_path / "ckpt", CheckpointConfig(every_steps=1)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state, make_iterator(), meta={"layout": 1})
    # a truncated array file in the newest step, unreadable metadata in the one before
    for f in (tmp_path / "ckpt" / "3" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    (tmp_path / "ckpt" / "2" / "state" / "_METADATA").write_text("{not json")
    with Checkpointer(tmp_path / "ckpt", CheckpointConfig(every_steps=1)) as ckpt:
        resumed = ckpt.resume(abstract, make_iterator, meta={"layout": 1})
        assert resumed.step == 1 and resumed.data_restored
        assert_same(resumed.state, state)
        assert [p.name for p in resumed.quarantined] == ["3", "2"]
        assert len(resumed.reasons) == 2 and "_METADATA" in resumed.reasons[1]
        assert ckpt.all_steps() == [1]
        # another data layout: the state restores, the iterator is left fresh
        other = ckpt.resume(abstract, make_iterator, meta={"layout": 2})
        assert other.step == 1 and not other.data_restored
    record = next(r for r in caplog.records if "is corrupt" in r.msg)
    assert record.levelno == logging.INFO and "/ckpt/3" in caplog.text
    quarantine = tmp_path / "ckpt.quarantine"
    assert sorted(p.name for p in quarantine.iterdir()) == ["2", "3"]  # kept, not deleted


def test_keeps_latest_and_best_by_eval_loss(tmp_path):
    state = make_state(mesh((2, 4)))
    cfg = CheckpointConfig(every_steps=1, keep=2, keep_best=1, async_save=False)
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 2.5, 5: 4.0, 6: None}
    with Checkpointer(tmp_path, cfg) as ckpt:
        for step, loss in losses.items():
            ckpt.save(step, state, metrics=None if loss is None else {"eval_loss": loss})
        ckpt.wait()
        assert ckpt.all_steps() == [2, 5, 6]  # best (2) + the 2 newest, even without a metric
    with Checkpointer(tmp_path, cfg) as ckpt:
        assert ckpt.resume(abstract_like(state)).step == 6


def test_single_process_save_writes_replicated_shards_whole(tmp_path, monkeypatch):
    """With every replica in one process, a save cuts no replica-parallel slices (Orbax's
    default issues one eager, freshly compiled lax.slice_in_dim per replica: seconds on the
    first save) and still restores exactly."""
    state = make_state(mesh((2, 4)))  # bias, mu and step are replicated over some axes
    values = jax.tree.map(np.asarray, state)
    slices, real_slice = [], jax.lax.slice_in_dim

    def counted_slice(*args, **kwargs):
        slices.append(args)
        return real_slice(*args, **kwargs)
    monkeypatch.setattr(jax.lax, "slice_in_dim", counted_slice)
    ckpt = Checkpointer(tmp_path / "ckpt", CheckpointConfig(every_steps=10))
    assert ckpt.save(10, state)
    ckpt.wait()
    assert slices == []
    restored, step = ckpt.restore(abstract_like(state))
    assert step == 10
    assert_same(restored, values)
    ckpt.close()


def test_resume_onto_other_shapes_raises_instead_of_quarantining(tmp_path):
    """Another width (no saved config here): before, every step was moved aside as corrupt
    and resume returned None, so the run started over."""
    from maxmoe.config import ConfigError

    ckpt_dir = tmp_path / "ckpt"
    with Checkpointer(ckpt_dir, CheckpointConfig(every_steps=1, async_save=False)) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": jnp.ones((4, 2))})
    with Checkpointer(ckpt_dir, CheckpointConfig(every_steps=1)) as ckpt:
        with pytest.raises(ConfigError) as info:
            ckpt.resume({"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)})
    assert str(info.value) == (
        f"checkpoint {ckpt_dir.resolve() / '2'} was saved for another model layout than this "
        "config builds (1 arrays differ, e.g. w: saved (4, 2), now (4, 3)); resume with the "
        "config it was saved with, or set run.dir to a new directory")
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["1", "2"]
    assert not (tmp_path / "ckpt.quarantine").exists()
    # another dtype is not another layout: Orbax casts (e.g. optimizer moments to bfloat16)
    with Checkpointer(ckpt_dir, CheckpointConfig(every_steps=1)) as ckpt:
        resumed = ckpt.resume({"w": jax.ShapeDtypeStruct(
            (4, 2), jnp.bfloat16, sharding=SingleDeviceSharding(jax.devices()[0]))})
    assert resumed.step == 2 and resumed.state["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(resumed.state["w"], np.float32), np.ones((4, 2)))


def test_resume_with_another_model_layout_is_a_config_error_that_moves_nothing(
        tmp_path, monkeypatch, capsys):
    """A checkpoint of stacked layers (scan_layers=true) resumed by a per-layer config: before
    this check, every step failed to restore, was quarantined as corrupt, and the run started
    from scratch. Now `maxmoe train` exits 2 naming the key, before anything compiles."""
    from maxmoe.cli import main
    from maxmoe.config_files import to_dict
    from maxmoe.sharding import make_mesh
    from maxmoe.train.step import make_trainer
    from maxmoe.validation import validate
    from tests.helpers import SMALL, small_config

    monkeypatch.setenv("MAXMOE_CACHE", str(tmp_path / "cache"))
    items = SMALL + ["model.vocab_size=512", "train.steps=1", f"run.dir={tmp_path / 'run'}"]
    cfg, origins = small_config(*items[len(SMALL):])
    trainer = make_trainer(cfg, make_mesh(validate(cfg, 8, origins)))
    ckpt_dir = tmp_path / "run" / "checkpoints"
    with Checkpointer(ckpt_dir, CheckpointConfig(every_steps=1, async_save=False)) as ckpt:
        assert ckpt.save(3, trainer.init(), config=to_dict(cfg))
    capsys.readouterr()
    assert main(["train", *items, "model.scan_layers=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"maxmoe: error: checkpoint {ckpt_dir / '3'} was saved for another "
                          "model layout"), err
    assert "model.scan_layers (saved True, now False)" in err, err
    assert "arrays differ, e.g. params/layer_groups/0/0/attn/k: saved absent, now " \
        "(64, 2, 16)" in err, err
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["3"]  # nothing moved or deleted
    assert not (tmp_path / "run" / "checkpoints.quarantine").exists()


def test_registering_the_array_handler_logs_nothing(monkeypatch, caplog):
    """maxmoe's jax.Array handler replaces Orbax's on purpose: Orbax's absl warning about the
    override ("Type handler registry type ... overriding ...") is not printed by every command."""
    default = ocp.type_handlers.ArrayHandler()  # as if nothing of maxmoe's were registered
    monkeypatch.setattr(ocp.type_handlers, "get_type_handler", lambda ty: default)
    with caplog.at_level(logging.INFO):
        checkpoint_handlers.register_array_handler()
    assert not [r for r in caplog.records if "Type handler registry" in r.getMessage()]
    assert logging.getLogger("absl").filters == []  # the filter went with the call
