"""Metric writers: metrics.jsonl arrays, TensorBoard tags of any record (read back from the
event file), events.jsonl from the guard, the progress line's ETA, W&B offline, and a tiny real
run that writes tensorboard/ and events.jsonl."""

import io
import json
import re
import struct
import sys
import types

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from maxmoe.config import Config, ConfigError, GuardConfig, LoggingConfig
from maxmoe.metrics import progress as progress_mod
from maxmoe.metrics.events import EventLog
from maxmoe.metrics.progress import Progress, duration, progress_metrics, say, si
from maxmoe.metrics.tensorboard import Heatmap, TensorBoardWriter, flatten
from maxmoe.metrics.wandb_writer import RUN_ID_FILE, WandbWriter, check_wandb
from maxmoe.metrics.writers import Background, MetricsWriter
from maxmoe.train.guards import Action, Guard
from tests.helpers import small_config
from tests.train.test_guards import _train

L, L_MOE, E = 5, 3, 8  # all layers, MoE layers, experts


def contract_record(rng) -> dict:
    """A record with every shape of the observability contract (obs_contract.md)."""
    load = rng.random((L_MOE, E))
    return {
        "loss": 2.5, "grad_norm": np.float32(1.25), "skipped": np.bool_(False),
        "expert_load_fraction": (load / load.sum(1, keepdims=True)).astype(np.float32),
        "router_entropy": rng.random(L_MOE), "router_bias": rng.standard_normal((L_MOE, E)),
        "dropped_fraction_by_layer": np.zeros(L_MOE),
        "activation_rms_by_layer": rng.random(L), "update_ratio_by_layer": rng.random(L),
        "grad_norm_by_group": {"attention": rng.random(L), "experts": rng.random(L_MOE),
                               "embedding": 0.5, "head": np.float32(0.25)},
        "load_max_mean_ratio": rng.random(L_MOE), "load_cv": rng.random(L_MOE),
        "dead_experts": {"1": [2, 5], "2": []}, "dead_expert_count": 2,
        "tokens_seen": 4096, "eval_loss": float("nan"), "note": "text is left out",
    }


def read_events(directory) -> list:
    """Every Event of the TFRecord event files in `directory` (length, crc, payload, crc)."""
    events = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            events.append(event_pb2.Event.FromString(data[at + 12:at + 12 + n]))
            at += 12 + n + 4
    return events


def test_jsonl_keeps_arrays_as_nested_lists_and_nonfinite_as_null(tmp_path):
    record = contract_record(np.random.default_rng(0))
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write(3, record)
    writer.close()
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert row["step"] == 3 and row["eval_loss"] is None and row["skipped"] == 0.0
    assert np.asarray(row["expert_load_fraction"]).shape == (L_MOE, E)
    # float32 values as their shortest float32 decimal: exact once read back as float32
    np.testing.assert_array_equal(np.asarray(row["expert_load_fraction"], np.float32),
                                  record["expert_load_fraction"])
    np.testing.assert_allclose(row["router_bias"], record["router_bias"], rtol=1e-15)  # float64
    assert len(row["grad_norm_by_group"]["attention"]) == L
    assert row["grad_norm_by_group"]["head"] == 0.25 and row["dead_experts"]["1"] == [2, 5]
    MetricsWriter(tmp_path / "absent", enabled=False).write(1, record)  # other processes


def test_tensorboard_tags_of_every_contract_shape(tmp_path):
    """Every shape in the metrics contract reaches TensorBoard, read back from the event file:
    scalars as scalars (float32, rel 1e-6), per-layer arrays as one scalar tag per layer, expert
    loads and router biases as per-layer histograms, the load matrix as a heatmap image;
    non-finite values and text are left out and the sink does not fail."""
    record = contract_record(np.random.default_rng(1))
    sink = Background(TensorBoardWriter(tmp_path / "tb"), "tensorboard")
    for step in (10, 20):
        sink.write(step, record)
    sink.close()
    assert not sink.failed
    scalars, histograms, images = {}, set(), set()
    for event in read_events(tmp_path / "tb"):
        for v in event.summary.value:
            kind = v.WhichOneof("value")
            if kind == "simple_value":
                scalars[(v.tag, event.step)] = v.simple_value
            elif kind == "histo":
                histograms.add((v.tag, event.step))
            elif kind == "image":
                images.add((v.tag, event.step, v.image.height > 50 and v.image.width > 50))
    tags = {t for t, _ in scalars}
    assert scalars[("loss", 20)] == 2.5 and scalars[("grad_norm_by_group/head", 10)] == 0.25
    assert {f"activation_rms_by_layer/layer_{i:02d}" for i in range(L)} <= tags
    assert {f"grad_norm_by_group/attention/layer_{i:02d}" for i in range(L)} <= tags
    assert {f"router_entropy/layer_{i:02d}" for i in range(L_MOE)} <= tags
    assert scalars[("activation_rms_by_layer/layer_04", 10)] == pytest.approx(
        record["activation_rms_by_layer"][4], rel=1e-6)  # float32 in the event file
    assert (scalars[("dead_experts/layer_01", 20)], scalars[("dead_experts/layer_02", 20)]) == (2, 0)
    assert "eval_loss" not in tags and "note" not in tags  # non-finite and text left out
    for key in ("expert_load_fraction", "router_bias"):
        assert {(f"{key}/layer_{i:02d}", s) for i in range(L_MOE) for s in (10, 20)} <= histograms
    assert images == {("expert_load_fraction/heatmap", s, True) for s in (10, 20)}


def test_flatten_reads_metrics_jsonl_nulls():
    flat = flatten({"update_ratio_by_layer": [0.1, None, 0.3], "router_bias": [[1.0, None]]})
    assert set(flat.scalars) == {"update_ratio_by_layer/layer_00", "update_ratio_by_layer/layer_02"}
    np.testing.assert_array_equal(flat.histograms["router_bias/layer_00"], [1.0])


def test_a_failing_sink_warns_once_and_training_goes_on(capsys):
    class Broken:
        closed = False

        def write(self, step, record):
            raise OSError("disk full")

        def close(self):
            Broken.closed = True

    sink = Background(Broken(), "tensorboard")
    for step in range(3):
        sink.write(step, {})
    sink.close()
    err = capsys.readouterr().err
    assert err.count("warning: the tensorboard writer failed at step 0 (OSError: disk full)") == 1
    assert Broken.closed


def test_guard_events_go_to_events_jsonl(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    cfg = GuardConfig(max_consecutive_skips=3, spike_action="rollback", max_rollbacks=1)
    guard = Guard(cfg, log=lambda _: None, events=log)
    base = {"loss": 2.0, "grad_norm": 1.0}
    assert guard.observe(5, {**base, "skipped": 0}).action is Action.CONTINUE
    guard.observe(6, {**base, "skipped": 1, "nonfinite": 1, "consecutive_skips": 1})
    guard.observe(7, {**base, "skipped": 1, "spike": 1, "consecutive_skips": 1})
    guard.observe(8, {**base, "skipped": 1, "nonfinite": 1, "consecutive_skips": 3})
    guard.observe(9, {**base, "activation_rms_max": 500.0})
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "events.jsonl").open()]
    assert [(r["step"], r["kind"]) for r in rows] == [(6, "skip"), (7, "spike"), (8, "stop"),
                                                      (9, "warning")]
    assert "non-finite" in rows[0]["message"] and "3 updates in a row" in rows[2]["message"]
    with pytest.raises(ValueError, match="not one of"):
        EventLog(None).emit(1, "typo", "")


def test_plain_lines_show_tokens_and_an_eta(capsys, monkeypatch):
    clock = iter([100.0, 110.0, 120.0])
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: next(clock))
    shown = Progress(total_steps=50, bar=False)
    record = {"loss": 2.0, "tokens_per_second": 1000.0, "mfu": 0.1, "tokens_seen": 2_500_000}
    for step in (10, 20, 30):  # the first record starts the clock (after the compile)
        shown.write(step, record)
    lines = capsys.readouterr().err.splitlines()
    assert "eta" not in lines[0] and "tokens 2.5M" in lines[0]
    assert lines[1].endswith("eta 30s")  # 10 s per 10 steps, 30 steps to go
    assert lines[2].endswith("eta 20s")
    assert (si(1234), si(5.6e9), duration(3725), duration(125)) == ("1.23k", "5.6B", "1h02m",
                                                                    "2m05s")


def test_progress_metrics_on_one_cpu_process():
    """On one CPU process the progress metrics are the tokens seen (step x tokens a step) alone:
    no device memory statistics, and the per-process step times are this process's own, not
    gathered."""
    out = progress_metrics(7, 512, 0.25)
    assert out == {"tokens_seen": 3584}  # no memory statistics on CPU; one process: no gather
    assert progress_mod.step_times_by_process(0.25) == [0.25]
    assert progress_mod.step_times_by_process(None) == [None]


def test_wandb_config_errors(monkeypatch):
    """W&B settings are checked only when a project is set: an unknown logging.wandb_mode and a
    missing wandb package are ConfigErrors naming the key or the pip command."""
    check_wandb(LoggingConfig())  # off: nothing checked
    with pytest.raises(ConfigError, match=r"logging.wandb_mode.*unknown mode"):
        check_wandb(LoggingConfig(wandb_project="p", wandb_mode="sometimes"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"wandb package is not installed; pip install "
                                          r"'maxmoe\[wandb\]'"):
        check_wandb(LoggingConfig(wandb_project="p"))


def test_heatmap_pixels_follow_the_values():
    """Blocks of pixels per cell, viridis from the array's min (dark) to its max (yellow);
    a reused Heatmap colours as a fresh one does; non-finite cells are black."""
    rng = np.random.default_rng(2)
    first, second = rng.random((L_MOE, E)), 10 * rng.random((L_MOE, E))
    reused = Heatmap()
    reused(first)
    image = reused(second)
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    block = image.shape[0] // L_MOE
    assert image.shape[:2] == (L_MOE * block, E * block) and block > 1
    np.testing.assert_array_equal(image, Heatmap()(second))
    assert not np.array_equal(image, Heatmap()(first))
    brightness = image[::block, ::block].astype(int).sum(-1)  # one pixel per cell
    low, high = np.unravel_index(second.argmin(), second.shape), np.unravel_index(
        second.argmax(), second.shape)
    assert brightness[low] == brightness.min() and brightness[high] == brightness.max()
    holes = second.copy()
    holes[0, 0] = np.nan
    assert not Heatmap()(holes)[:block, :block].any()


def test_wandb_offline_run_writes_its_directory(tmp_path):
    pytest.importorskip("wandb")
    from maxmoe.metrics.wandb_writer import WandbWriter  # noqa: I001 - after the skip

    cfg, _ = small_config("logging.wandb_project=maxmoe-test", f"run.dir={tmp_path}")
    writer = WandbWriter(cfg, tmp_path)  # offline by default: no network
    for step in (1, 2):
        writer.write(step, contract_record(np.random.default_rng(step)))
    writer.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert (run / f"run-{run.name.rsplit('-', 1)[1]}.wandb").stat().st_size > 1000
    assert len(list(run.glob("files/media/images/expert_load_fraction/heatmap_*.png"))) == 2


@pytest.mark.slow
def test_a_tiny_run_writes_tensorboard_and_events(tmp_path, monkeypatch, capsys):
    """The real loop (test_guards' fixture, 6 steps, its second layer MoE): batch 2 has a NaN,
    so step 3 is skipped; tensorboard/ gets the loop's scalars and per-layer tags, events.jsonl
    the skip."""
    _, records = _train(tmp_path, monkeypatch, "run", {2: "nan"}, "train.steps=6",
                        "model.num_dense_layers=1")  # layer 1 MoE: per-layer tags
    run = tmp_path / "run"
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["tokens_seen"] for r in records] == [512 * s for s in range(1, 7)]  # 16 x 32
    events = [json.loads(line) for line in (run / "events.jsonl").open()]
    assert [(e["step"], e["kind"]) for e in events] == [(3, "skip")]
    assert "update skipped: non-finite" in events[0]["message"]
    steps = {}
    for event in read_events(run / "tensorboard"):
        for v in event.summary.value:
            steps.setdefault(v.tag, set()).add(event.step)
    assert steps["tokens_per_second"] == steps["tokens_seen"] == set(range(1, 7))
    assert steps["loss"] == {1, 2, 4, 5, 6}  # step 3's loss is NaN: null in JSONL, not in TB
    # the per-layer tags of the loop's own records (1 dense + 1 MoE layer of 8 experts)
    assert steps["expert_load_fraction/heatmap"] == set(range(1, 7))
    assert {"router_entropy/layer_00", "load_cv/layer_00", "activation_rms_by_layer/layer_01",
            "grad_norm_by_group/experts/layer_00", "expert_load_fraction/layer_00"} <= set(steps)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("step 6: loss")]
    assert len(lines) == 1 and " eta 0s" in lines[0] and "tokens 3.07k" in lines[0]


def test_tensorboard_drops_redone_steps_after_a_resume_or_rollback(tmp_path):
    """A SessionLog START at step N makes TensorBoard drop the events at N and after from
    earlier files and earlier in the file: the resumed run's and the rollback's redone steps."""
    writer = TensorBoardWriter(tmp_path, start_step=4)  # resumed from the step-4 checkpoint
    for step in (5, 6, 7, 6, 7):  # a rollback after step 7 to the step-5 checkpoint
        writer.write(step, {"loss": float(step)})
    writer.close()
    starts = [e.step for e in read_events(tmp_path)
              if e.session_log.status == event_pb2.SessionLog.START]
    assert starts == [5, 6]


def test_wandb_restarts_resume_the_same_run(tmp_path, monkeypatch):
    """A restarted job (a new WandbWriter on the same run.dir) logs into the W&B run the first
    start created: the id kept in <run.dir>/wandb_run_id, with resume="allow". A fake wandb
    module stands in for the optional extra and records what init was given."""
    calls, ids = [], iter(["first01", "second2"])
    run = types.SimpleNamespace(define_metric=lambda *a, **k: None)
    fake = types.SimpleNamespace(init=lambda **kw: calls.append(kw) or run,
                                 util=types.SimpleNamespace(generate_id=lambda: next(ids)),
                                 Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = Config(logging=LoggingConfig(wandb_project="p"))
    for _ in range(2):
        WandbWriter(cfg, tmp_path)
    assert [c["id"] for c in calls] == ["first01", "first01"]
    assert all(c["resume"] == "allow" for c in calls)
    assert (tmp_path / RUN_ID_FILE).read_text().strip() == "first01"
    other = tmp_path / "other"
    other.mkdir()
    WandbWriter(cfg, other)  # another run directory: another run
    assert calls[-1]["id"] == "second2"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [False, True])
def test_progress_bar_only_on_a_terminal_and_lines_never_glued_to_it(terminal, monkeypatch):
    """logging.progress_bar=true draws a tqdm bar only when stderr is a terminal; redirected to
    a file, it prints plain lines (no cursor codes). Lines said meanwhile (eval, guards) start a
    line of their own, above the bar."""
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    shown = Progress(total_steps=50, bar=True)
    record = {"loss": 2.0, "tokens_per_second": 1000.0, "mfu": 0.1, "tokens_seen": 1000}
    shown.write(10, record)
    say("step 10: eval loss 4.7300 (1.0 s)")
    shown.write(20, record)
    shown.close()
    out = err.getvalue()
    assert re.search(r"(^|[\r\n])step 10: eval loss 4.7300 \(1.0 s\)\n", out), repr(out)
    if terminal:
        assert "train:" in out and "\r" in out
    else:
        assert "\r" not in out and "\x1b" not in out and "train:" not in out, repr(out)
        assert out.splitlines()[0].startswith("step 10: loss 2.0000")
