"""Cluster and device-kind files load as their YAML says, overrides win, and every bad spec or
file is refused with one ConfigError line naming what is wrong."""

import pytest
import yaml

from maxmoe.cluster import (
    EFFICIENCY_FIELDS,
    PACKAGE_CONFIGS,
    known_clusters,
    known_kinds,
    load_cluster,
)
from maxmoe.config import ConfigError

SHIPPED_KINDS = {"h800", "h100", "h200", "b200", "a100", "cpu"}
SHIPPED_CLUSTERS = {"deepseek_v3_h800", "llama3_405b_h100"}


def kind_yaml(kind: str) -> dict:
    return yaml.safe_load((PACKAGE_CONFIGS / "devices" / f"{kind}.yaml").read_text())


def test_shipped_files_are_all_known():
    assert SHIPPED_KINDS <= set(known_kinds())
    assert SHIPPED_CLUSTERS <= set(known_clusters())


@pytest.mark.parametrize("kind", sorted(SHIPPED_KINDS))
def test_every_device_kind_loads_as_its_file_says(kind):
    raw = kind_yaml(kind)
    c = load_cluster(f"{raw['devices_per_host']}x{kind}")
    assert (c.kind, c.hosts, c.devices) == (kind, 1, raw["devices_per_host"])
    assert c.memory_bytes == int(raw["memory_gib"] * 2**30)
    assert c.peak_fp8_flops >= c.peak_bf16_flops > 0
    assert c.price_source and c.price_date and c.price_per_device_hour > 0
    for field in EFFICIENCY_FIELDS:  # a kernel-level figure comes with its published source
        value, source = getattr(c, field), getattr(c, f"{field}_source")
        assert (value is None and not source) or (0 < value <= 1 and source), (field, value)
    if kind in ("h100", "h200", "h800"):  # the Hopper files carry every figure
        assert None not in [getattr(c, f) for f in EFFICIENCY_FIELDS]


@pytest.mark.parametrize("name", sorted(SHIPPED_CLUSTERS))
def test_every_cluster_file_loads(name):
    raw = yaml.safe_load((PACKAGE_CONFIGS / "cluster" / f"{name}.yaml").read_text())
    c = load_cluster(name)
    assert (c.name, c.kind, c.devices) == (name, raw["kind"], raw["devices"])
    assert c.hosts * c.devices_per_host == c.devices
    for key, value in raw.items():  # the file's own figures win over its kind's
        assert getattr(c, key) == value


def test_2048xh800_is_256_hosts_with_four_fifths_usable():
    raw = kind_yaml("h800")
    c = load_cluster("2048xh800")
    assert c.hosts == 2048 // 8 == 256
    assert c.usable_fraction == 0.8
    assert c.usable_bytes == pytest.approx(0.8 * raw["memory_gib"] * 2**30, abs=2)  # two int()s
    assert load_cluster("deepseek_v3_h800").hosts == 256


def test_cluster_file_override_wins_over_the_kind(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("kind: h100\ndevices: 16\nprice_per_device_hour: 1.5\nusable_fraction: 0.9\n")
    c = load_cluster(str(path))
    base = load_cluster("16xh100")
    assert (c.name, c.hosts, c.price_per_device_hour) == ("mine", 2, 1.5)
    assert base.price_per_device_hour == kind_yaml("h100")["price_per_device_hour"] != 1.5
    assert c.usable_bytes == int(c.memory_bytes * 0.9) and c.usable_bytes > base.usable_bytes
    assert c.peak_bf16_flops == base.peak_bf16_flops  # what the file does not set stays


def test_spec_forms_and_the_current_directorys_configs(tmp_path, monkeypatch):
    """A --cluster spec may be a file name with or without .yaml, NxKIND (any case; fewer
    devices than a host is one host) or a path; configs/cluster/ in the working directory is
    searched too, and the package's files are still found."""
    assert load_cluster("deepseek_v3_h800.yaml") == load_cluster("deepseek_v3_h800")
    assert load_cluster("8xH200").kind == "h200"
    assert load_cluster("1xh200").hosts == 1  # part of one host
    (tmp_path / "configs" / "cluster").mkdir(parents=True)
    (tmp_path / "configs" / "cluster" / "local.yaml").write_text("kind: b200\ndevices: 64\n")
    monkeypatch.chdir(tmp_path)
    assert load_cluster("local").hosts == 8
    assert load_cluster("configs/cluster/local.yaml").devices == 64
    assert load_cluster("2048xh800").hosts == 256  # the package's kinds still found
    assert load_cluster("configs/cluster/deepseek_v3_h800.yaml").devices == 2048  # package's


def one_line_error(spec: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_cluster(spec)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("spec, names", [
    ("8xh900", ["'h900'", "unknown device kind", "h800", "b200"]),  # lists the known kinds
    ("12xh800", ["12 devices", "devices_per_host=8"]),
    ("0xh800", ["'0xh800'", "at least 1"]),
    ("-8xh800", ["'-8xh800'", "at least 1"]),
    ("2048h800", ["'2048h800'", "COUNTxKIND"]),
    ("8x", ["'8x'", "COUNTxKIND"]),
    ("h100x256", ["'h100x256'", "mesh file"]),
    ("configs/mesh/h100x256.yaml", ["mesh file"]),
    ("nowhere", ["'nowhere'", "deepseek_v3_h800"]),
    ("no/such.yaml", ["'no/such.yaml'", "not found"]),
])
def test_bad_specs_name_the_offender(spec, names):
    message = one_line_error(spec)
    for part in names:
        assert part in message


@pytest.mark.parametrize("text, names", [
    ("kind: h100\n", ["'devices'", "missing"]),
    ("devices: 8\n", ["'kind'", "missing"]),
    ("kind: h999\ndevices: 8\n", ["'h999'", "unknown device kind", "h100"]),
    ("kind: h100\ndevices: many\n", ["'devices'", "'many'"]),
    ("kind: h100\ndevices: 8\npeak_bf16_flop: 1.0e15\n", ["'peak_bf16_flop'", "unknown key"]),
    ("kind: h100\ndevices: 8\nici_bandwidth: fast\n", ["'ici_bandwidth'", "'fast'"]),
    ("kind: h100\ndevices: 8\nusable_fraction: 1.5\n", ["'usable_fraction'", "(0, 1]"]),
    ("kind: h100\ndevices: 8\ngemm_efficiency_bf16: 1.2\n", ["'gemm_efficiency_bf16'", "(0, 1]"]),
    ("kind: cpu\ndevices: 8\ngemm_efficiency_fp8: 0.5\n",
     ["'gemm_efficiency_fp8_source'", "missing beside gemm_efficiency_fp8"]),
    ("kind: cpu\ndevices: 8\nattention_efficiency_bf16_source: a paper\n",
     ["'attention_efficiency_bf16'", "missing beside attention_efficiency_bf16_source"]),
    ("kind: h100\ndevices: 12\n", ["12 devices", "devices_per_host=8"]),
    ("mesh:\n  data: 8\n", ["mesh file"]),
])
def test_bad_cluster_files_name_file_and_key(tmp_path, text, names):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    message = one_line_error(str(path))
    assert str(path) in message
    for part in names:
        assert part in message


def test_device_kind_file_missing_or_mislabelled_field(tmp_path, monkeypatch):
    devices = tmp_path / "configs" / "devices"
    devices.mkdir(parents=True)
    raw = kind_yaml("h100")
    del raw["peak_fp8_flops"]
    (devices / "nofp8.yaml").write_text(yaml.safe_dump({**raw, "kind": "nofp8"}))
    (devices / "other.yaml").write_text(yaml.safe_dump(kind_yaml("h100")))  # says kind: h100
    monkeypatch.chdir(tmp_path)
    message = one_line_error("8xnofp8")
    assert "'peak_fp8_flops'" in message and "nofp8.yaml" in message and "missing" in message
    assert "file name 'other'" in one_line_error("8xother")


def test_a_cluster_file_overriding_an_efficiency_gives_its_source(tmp_path):
    """A lent GPU's measurement may replace a published figure, but only with its own source:
    the kind file's source would then describe another number."""
    path = tmp_path / "measured.yaml"
    path.write_text("kind: h100\ndevices: 8\ngemm_efficiency_bf16: 0.7\n")
    assert "'gemm_efficiency_bf16_source'" in one_line_error(str(path))
    path.write_text("kind: h100\ndevices: 8\ngemm_efficiency_bf16: 0.7\n"
                    "gemm_efficiency_bf16_source: lent H100, tools/bench_grouped_matmul.py\n")
    c = load_cluster(str(path))
    kind = load_cluster("8xh100")
    assert (c.gemm_efficiency_bf16, c.gemm_efficiency_fp8) == (0.7, kind.gemm_efficiency_fp8)
    assert kind.gemm_efficiency_bf16 != 0.7  # the file's figure won
    assert c.gemm_efficiency_bf16_source.startswith("lent H100")
