"""The deviceless XLA:GPU target (plan/gpu_aot.target_config) is built from configs/devices/
KIND.yaml's gpu_target and declares the installed cuDNN wheel's version (no plugin needed)."""

import importlib.metadata

import pytest
import yaml

from maxmoe.cluster import PACKAGE_CONFIGS, gpu_target
from maxmoe.config import ConfigError
from maxmoe.plan import gpu_aot


@pytest.fixture
def cudnn(monkeypatch):
    """Fakes the installed cuDNN wheel's version (None: not installed)."""
    real = importlib.metadata.version

    def use(version):
        def fake(name):
            if name != gpu_aot.CUDNN_WHEEL:
                return real(name)
            if version is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return version
        monkeypatch.setattr(importlib.metadata, "version", fake)
    return use


@pytest.mark.parametrize("kind", ["h100", "h800", "h200", "b200"])
def test_target_is_the_device_file(cudnn, kind):
    cudnn("9.28.0.42")  # what jax[cuda12] 0.12.0.1 installed here (RUNTIME_FACTS.md)
    raw = yaml.safe_load((PACKAGE_CONFIGS / "devices" / f"{kind}.yaml").read_text())
    text = gpu_aot.target_config(kind)
    t = raw["gpu_target"]
    for key, value in [("core_count", t["sm_count"]), ("clock_rate_ghz", t["clock_ghz"]),
                       ("device_memory_size", t["memory_bytes"]),
                       ("memory_bandwidth", t["memory_bandwidth"]),
                       ("l2_cache_size", t["l2_cache_bytes"])]:
        assert f"  {key}: {value}\n" in text, key
    major, minor = t["compute_capability"].rstrip("a").split(".")
    assert (f"cuda_compute_capability {{ major: {major} minor: {minor} "
            "feature_extension: ACCELERATED_FEATURES }") in text
    assert "dnn_version_info { major: 9 minor: 28 patch: 0 }" in text
    assert f'device_description_str: "{raw["device_name"]}"' in text


def test_cudnn_version_is_read_from_the_wheel(cudnn):
    cudnn("9.10.2.21")
    assert gpu_aot.cudnn_version() == (9, 10, 2)
    assert "dnn_version_info { major: 9 minor: 10 patch: 2 }" in gpu_aot.target_config("h100")
    cudnn(None)
    with pytest.raises(ConfigError, match="nvidia-cudnn-cu12 wheel is not installed"):
        gpu_aot.target_config("h100")


def test_kinds_without_a_target_are_refused(cudnn):
    cudnn("9.28.0")
    assert gpu_target("a100") is None and gpu_target("cpu") is None
    assert gpu_aot.target_kinds() == ["b200", "h100", "h200", "h800"]
    with pytest.raises(ConfigError, match="'a100' has no gpu_target.*b200, h100, h200, h800"):
        gpu_aot.target_config("a100")


def test_bad_gpu_target_figures_name_the_key(tmp_path, monkeypatch):
    devices = tmp_path / "configs" / "devices"
    devices.mkdir(parents=True)
    raw = yaml.safe_load((PACKAGE_CONFIGS / "devices" / "h100.yaml").read_text())
    cases = {"nocap": ("compute_capability", "sm90", "is not MAJOR.MINOR[a]"),
             "nosms": ("sm_count", 0, "must be a positive int"),
             "extra": ("tflops", 1, "unknown key")}
    for name, (key, value, _) in cases.items():
        (devices / f"{name}.yaml").write_text(yaml.safe_dump(
            {**raw, "kind": name, "gpu_target": {**raw["gpu_target"], key: value}}))
    monkeypatch.chdir(tmp_path)
    for name, (key, _, problem) in cases.items():
        with pytest.raises(ConfigError) as e:
            gpu_target(name)
        assert f"'gpu_target.{key}'" in str(e.value) and problem in str(e.value), str(e.value)
