"""`maxmoe train --dry-run`: compiles on the devices present, prints the memory line and the
plan's figures, writes nothing. (plan.json of a normal run: tests/train/test_resume.py.)"""

from __future__ import annotations

import json

from maxmoe.cli import main
from maxmoe.cluster import gpu_target, kind_named, kind_slug, known_kinds
from maxmoe.config import CheckpointConfig
from maxmoe.config_files import save_config, to_dict
from maxmoe.plan import live
from maxmoe.sharding import make_mesh
from maxmoe.train.checkpoint import Checkpointer
from maxmoe.train.step import make_trainer
from maxmoe.validation import validate
from tests.helpers import SMALL, small_config

CONTRACT = {"mesh", "devices", "peak_bytes_per_device", "argument_bytes_per_device",
            "device_memory_bytes", "fits", "replicated_state_bytes_per_device",
            "collective_bytes_per_step", "step_time_s", "tokens_per_second", "mfu",
            "device_hours_per_trillion_tokens", "cost_usd"}


def snapshot(root) -> dict:
    """Every path under `root` -> (bytes or None for a folder, mtime in ns)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def test_dry_run_of_tiny_prints_memory_and_makes_no_run_dir(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "tiny"
    assert main(["train", "configs/tiny.yaml", f"run.dir={run_dir}", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "runs").exists()
    assert "memory/device  peak " in out and "= arguments " in out, out
    assert "dry run: data 2 x fsdp 2 x expert 2" in out, out
    figures = json.loads(out.strip().splitlines()[-1])
    assert CONTRACT <= set(figures), CONTRACT - set(figures)
    assert figures["fits"] is True and figures["devices"] == 8
    assert figures["cluster"] == "8xcpu" and figures["step_time_s"] > 0
    assert figures["stand_ins"] == {}  # the real devices' kernels, no CPU stand-ins


def test_dry_run_leaves_an_existing_run_dir_byte_identical(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MAXMOE_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    items = [*SMALL, "train.steps=4", f"run.dir={run_dir}"]
    cfg, origins = small_config(*items[len(SMALL):])
    trainer = make_trainer(cfg, make_mesh(validate(cfg, 8, origins)))
    with Checkpointer(run_dir / "checkpoints",
                      CheckpointConfig(every_steps=1, async_save=False)) as ckpt:
        assert ckpt.save(3, trainer.init(), config=to_dict(cfg))
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text('{"step": 3, "loss": 5.0}\n')
    before = snapshot(run_dir)
    assert main(["train", *items, "--dry-run"]) == 0
    assert snapshot(run_dir) == before
    assert "memory/device  peak " in capsys.readouterr().out


def test_a_bad_cluster_is_refused_before_the_compile(tmp_path, capsys):
    args = ["train", "configs/tiny.yaml", f"run.dir={tmp_path / 'r'}", "--dry-run"]
    assert main([*args, "--cluster", "8xtpu9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown device kind 'tpu9'" in err[0], err
    assert not (tmp_path / "r").exists()


def test_live_cluster_takes_the_job_s_device_counts():
    cluster = live.live_cluster()  # conftest's 8 fake CPU devices in one process
    assert (cluster.kind, cluster.devices, cluster.devices_per_host) == ("cpu", 8, 8)
    h200 = live.live_cluster("1xh200")  # --cluster prices the kind; the counts stay the job's
    assert (h200.kind, h200.name, h200.devices, h200.devices_per_host) == ("h200", "8xh200", 8, 8)
    assert h200.memory_gib > 100


def test_jax_device_kinds_find_their_files_by_device_name():
    for device_name, kind in [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H800", "h800"),
                              ("NVIDIA H200", "h200"), ("NVIDIA B200", "b200"),
                              ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L40S", None)]:
        assert kind_named(device_name) == kind, device_name
    for kind in ("h100", "h800", "h200", "b200"):  # the compile target names the same GPU
        assert kind_named(gpu_target(kind)["device_name"]) == kind
    assert "nvidia_l40s" not in known_kinds() and kind_slug("NVIDIA L40S") == "nvidia_l40s"


def test_an_unknown_kind_keeps_its_memory_figures_and_says_how_to_add_it(monkeypatch):
    monkeypatch.setattr(live, "allocator_limit", lambda: 80 * 2**30)
    memory = {"peak_bytes": 90 * 2**30, "argument_bytes": 30 * 2**30}
    measured = {"memory": memory, "mesh": {"fsdp": 8}, "devices": 8, "collectives": {},
                "replicated_state_bytes": 0, "replicated": [], "largest_buffers": []}
    figures = live.memory_only_figures(measured)
    assert CONTRACT <= set(figures)
    assert figures["fits"] is False and figures["step_time_s"] is None
    figures["device_kind"] = "NVIDIA L40S"
    line = live.unknown_kind_line(figures)
    assert "does NOT fit the allocator's 80.0 GiB" in line, line
    assert "configs/devices/nvidia_l40s.yaml" in line, line
    assert 'device_name: "NVIDIA L40S"' in line, line  # how a job's devices find the file
