"""The MFU peak per device kind: a GPU's configs/devices/ file (found by its device_name), a
given logging.peak_flops_per_device, a measured matmul on CPU only; an accelerator kind with no
file gets one warning line and no MFU, never a host matmul as its peak."""

from types import SimpleNamespace

import jax
import pytest

from maxmoe.config_files import load_config
from maxmoe.metrics import flops as flops_module
from maxmoe.metrics.flops import MatmulPeak, fp8_peak_flops, mfu_peak, peak_flops, peak_meter


@pytest.fixture
def gpu(monkeypatch):
    """Makes jax.devices() report GPUs of the given device_kind (what cluster.device_kind and
    the peaks read); the warning's once-per-kind cache starts empty."""
    flops_module._warn_no_peak.cache_clear()

    def use(kind: str) -> None:
        device = SimpleNamespace(platform="gpu", device_kind=kind)
        monkeypatch.setattr(jax, "devices", lambda *a, **k: [device])
    yield use
    flops_module._warn_no_peak.cache_clear()


def _cfg(*overrides):
    cfg, _ = load_config(["configs/tiny.yaml"], ["precision.compute_dtype=bfloat16", *overrides])
    return cfg


def test_unknown_gpu_gets_one_warning_and_no_mfu(gpu, capsys, monkeypatch):
    gpu("NVIDIA L40S")
    monkeypatch.setattr(MatmulPeak, "__init__", lambda *a, **k: pytest.fail("host matmul"))
    cfg = _cfg()
    assert peak_meter(cfg) is None
    assert peak_flops(cfg) is None and mfu_peak(cfg) is None and mfu_peak(cfg) is None
    assert fp8_peak_flops(cfg, None) is None
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "'NVIDIA L40S'" in lines[0] and "configs/devices/nvidia_l40s.yaml" in lines[0]
    assert "MFU is left out" in lines[0]


def test_a_given_peak_needs_no_file(gpu, capsys):
    gpu("NVIDIA L40S")
    cfg = _cfg("logging.peak_flops_per_device=362e12")
    assert peak_flops(cfg) == (362e12 * jax.device_count(), "logging.peak_flops_per_device")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("device_kind, bf16, fp8", [
    ("NVIDIA A100-SXM4-80GB", 312e12, 312e12),  # configs/devices/a100.yaml: no FP8 cores
    ("NVIDIA H100 80GB HBM3", 989e12, 1979e12),
    ("NVIDIA H800", 989e12, 1979e12),
])
def test_known_gpus_take_their_data_sheet(gpu, capsys, device_kind, bf16, fp8):
    gpu(device_kind)
    cfg, n = _cfg(), jax.device_count()
    peak = peak_flops(cfg)
    assert peak == (bf16 * n, f"{device_kind} bf16 data-sheet peak")
    assert fp8_peak_flops(cfg, peak)[0] == fp8 * n
    assert mfu_peak(cfg)[0] == bf16 * n and capsys.readouterr().err == ""


def test_cpu_keeps_its_measured_peak():
    meter = peak_meter(_cfg())
    assert isinstance(meter, MatmulPeak)
    rate, source = peak_flops(_cfg(), meter)
    assert rate > 0 and "matmul" in source


def test_progress_lines_without_mfu(capsys):
    """A run with no peak (no `mfu` in its records) shows no MFU, and the bar no placeholder."""
    from maxmoe.metrics.progress import Progress

    for bar in (False, True):
        shown = Progress(total_steps=50, bar=bar)
        shown.write(10, {"loss": 2.0, "tokens_per_second": 1000.0})
        shown.close()
    err = capsys.readouterr().err
    assert "step 10: loss 2.0000 tokens/s 1000" in err and "mfu" not in err, err


def test_training_window_without_a_peak_logs_no_mfu(gpu, capsys):
    """The training loop on an unknown GPU: log_window says MFU is left out, and its records
    carry tokens/s but no `mfu` key (metrics.jsonl, the report and the bar read it optionally)."""
    from maxmoe.metrics.flops import flops_per_token
    from maxmoe.train.reporting import log_window

    gpu("NVIDIA L40S")
    cfg = _cfg()
    setup = SimpleNamespace(cfg=cfg, tokens_per_step=2048, model_flops=flops_per_token(cfg) * 2048)
    window = log_window(setup)
    assert window.peak is None
    window.count()  # the first step starts the window
    window.count()
    record = window.close({"loss": 2.0}, {})
    assert "mfu" not in record and record["tokens_per_second"] > 0
    assert "MFU left out" in capsys.readouterr().err
