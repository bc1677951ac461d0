"""Cluster and device-kind files: what `maxmoe plan --cluster SPEC` prices a config against.

A device-kind file (configs/devices/KIND.yaml) gives one accelerator's memory, peaks, link
bandwidths and price, each figure with its source in a comment. A cluster file
(configs/cluster/NAME.yaml) names a kind, a device count and optionally overrides any kind field.
`load_cluster` reads either form, or builds `COUNTxKIND` (e.g. `2048xh800`) from the kind alone.
Mesh files (configs/mesh/) are a different thing: a spec pointing there is refused by name.
`device_kind` names the file of the devices a job runs on (the file whose `device_name` is
jax's device_kind): the planner prices them and the training loop's MFU divides by their
data-sheet peaks. A GPU kind's file may also hold `gpu_target:`, the figures the deviceless
XLA:GPU compile declares (plan/gpu_aot.py). configs/devices/ is the one source of device facts.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from pathlib import Path
from typing import Any

import jax
import yaml

from maxmoe.config import ConfigError, fail

# the repository's configs/ (source checkouts), then the current directory's configs/
PACKAGE_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
_SPEC = re.compile(r"(-?\d+)x([A-Za-z][\w-]*)")
_FORMS = "a cluster file path, a name under configs/cluster/, or COUNTxKIND such as 2048xh800"


@dataclasses.dataclass(frozen=True)
class Cluster:
    """One homogeneous cluster. Per-device figures unless named per host; bandwidths are the
    one-way bytes/s one device achieves (ICI: inside a host, DCN: across hosts)."""

    name: str
    kind: str
    devices: int
    devices_per_host: int
    memory_gib: float  # as the device reports it (nvidia-smi memory.total), GiB
    peak_bf16_flops: float  # dense, per device
    peak_fp8_flops: float  # dense, per device
    ici_bandwidth: float
    dcn_bandwidth: float
    storage_write_bandwidth: float  # per host, to the checkpoint store
    price_per_device_hour: float  # USD
    price_source: str
    price_date: str
    usable_fraction: float = 0.8  # of memory_gib left for the train step's buffers
    # kernel-level efficiencies (achieved / dense peak) with their sources; None where the kind's
    # file has no published figure (plan/roofline.py prices it at FALLBACK_EFFICIENCY, labelled)
    gemm_efficiency_bf16: float | None = None  # large bf16 GEMMs, of peak_bf16_flops
    gemm_efficiency_bf16_source: str = ""
    gemm_efficiency_fp8: float | None = None  # FP8 (E4M3) GEMMs, of peak_fp8_flops
    gemm_efficiency_fp8_source: str = ""
    attention_efficiency_bf16: float | None = None  # causal flash attention fwd + bwd, of bf16
    attention_efficiency_bf16_source: str = ""
    origin: str = ""  # the file(s) the figures came from

    @property
    def hosts(self) -> int:
        """Hosts the devices fill; a part of one host (1, 2 or 4 of 8 GPUs) is one host."""
        return max(1, self.devices // self.devices_per_host)

    @property
    def memory_bytes(self) -> int:
        """Device memory in bytes."""
        return int(self.memory_gib * 2**30)

    @property
    def usable_bytes(self) -> int:
        """Bytes per device a plan may fill: memory_bytes x usable_fraction."""
        return int(self.memory_bytes * self.usable_fraction)


_TYPES = {f.name: f.type for f in dataclasses.fields(Cluster)}
DEVICE_FIELDS = ("kind", "devices_per_host", "memory_gib", "usable_fraction", "peak_bf16_flops",
                 "peak_fp8_flops", "ici_bandwidth", "dcn_bandwidth", "storage_write_bandwidth",
                 "price_per_device_hour", "price_source", "price_date")
# kernel-level efficiency figures: each optional, each with its `FIELD_source` beside it
EFFICIENCY_FIELDS = ("gemm_efficiency_bf16", "gemm_efficiency_fp8", "attention_efficiency_bf16")
DEVICE_FIELDS += tuple(f for e in EFFICIENCY_FIELDS for f in (e, f"{e}_source"))
_OPTIONAL = {"usable_fraction", *DEVICE_FIELDS[-2 * len(EFFICIENCY_FIELDS):]}
CLUSTER_FIELDS = ("kind", "devices") + DEVICE_FIELDS[1:]
# a device-kind file's keys that are no Cluster field: jax's device_kind of the kind (how a job's
# devices find their file) and the deviceless XLA:GPU target's figures (gpu_target())
KIND_ONLY_FIELDS = ("device_name", "gpu_target")
# gpu_target's keys -> type; figures as the CUDA runtime reports them (cudaDeviceProp)
GPU_TARGET_FIELDS = {"compute_capability": str, "sm_count": int, "clock_ghz": float,
                     "memory_bytes": int, "memory_bandwidth": int, "l2_cache_bytes": int}
_CAPABILITY = re.compile(r"(\d+)\.(\d+)(a?)")


def _config_dirs(sub: str) -> list[Path]:
    """configs/SUB of the current directory, then of the package (deduplicated)."""
    dirs = []
    for root in (Path.cwd() / "configs", PACKAGE_CONFIGS):
        d = (root / sub).resolve()
        if d.is_dir() and d not in dirs:
            dirs.append(d)
    return dirs


def _names(sub: str) -> list[str]:
    return sorted({p.stem for d in _config_dirs(sub) for p in d.glob("*.yaml")})


def known_kinds() -> list[str]:
    """Device kinds with a file under configs/devices/."""
    return _names("devices")


def known_clusters() -> list[str]:
    """Cluster names with a file under configs/cluster/."""
    return _names("cluster")


def _find(sub: str, name: str) -> Path | None:
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    for d in _config_dirs(sub):
        if (d / f"{stem}.yaml").is_file():
            return d / f"{stem}.yaml"
    return None


def _read(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"cluster file {str(path)!r}: not valid YAML "
                          f"({str(e).splitlines()[0]}); fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"cluster file {str(path)!r}: top level must be a mapping; write e.g. "
                          "'kind: h800' and 'devices: 2048' on two lines")
    if "mesh" in data:
        _mesh_error(str(path))
    return data


def _mesh_error(spec: str) -> None:
    raise ConfigError(f"--cluster {spec!r}: is a mesh file (configs/mesh/), not a cluster; pass "
                      f"{_FORMS} (the mesh goes in the training config)")


def _number(key: str, value: Any, origin: str) -> float | int:
    tp = _TYPES[key]
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        fail(key, value, origin, f"must be a {tp}", "write a plain number")
    if tp == "int":
        if not isinstance(value, int):
            fail(key, value, origin, "must be a whole number", "write e.g. 8")
        if value < 1:
            fail(key, value, origin, "must be at least 1", "write a positive count")
        return value
    try:  # YAML 1.1 reads 989e12 (no dot) as a string
        number = float(value)
    except ValueError:
        fail(key, value, origin, "must be a number", "write e.g. 989.0e12")
    if key in ("usable_fraction", *EFFICIENCY_FIELDS) and not 0 < number <= 1:
        fail(key, value, origin, "must be in (0, 1]", "write a fraction such as 0.8")
    if number < 0 or (number == 0 and key != "price_per_device_hour"):
        fail(key, value, origin, "must be positive", "write the figure in bytes/s, FLOP/s or GiB")
    return number


def _checked(raw: dict, allowed: tuple[str, ...], origin: str) -> dict:
    """raw's keys checked against `allowed` and each value against its Cluster field type."""
    out = {}
    for key, value in raw.items():
        if key not in allowed:
            fail(key, value, origin, "unknown key", f"use one of {', '.join(allowed)}")
        if _TYPES[key] == "str":
            if isinstance(value, datetime.date):  # YAML reads an unquoted 2026-03-17 as a date
                value = value.isoformat()
            if not isinstance(value, str) or not value.strip():
                fail(key, value, origin, "must be a non-empty string", "quote it")
            out[key] = value
        else:
            out[key] = _number(key, value, origin)
    return out


def _kind_file(kind: str) -> tuple[dict, Path]:
    """(the raw mapping of configs/devices/KIND.yaml, that file); ConfigError if there is none."""
    path = _find("devices", kind)
    if path is None:
        raise ConfigError(f"device kind {kind!r}: unknown; use one of {', '.join(known_kinds())} "
                          f"or add configs/devices/{kind}.yaml")
    return _read(path), path


def load_device_kind(kind: str) -> tuple[dict, Path]:
    """(the checked Cluster fields of configs/devices/KIND.yaml, that file); usable_fraction may
    be absent (the Cluster default applies). KIND_ONLY_FIELDS are left out (gpu_target(),
    device_kind() read them)."""
    raw, path = _kind_file(kind)
    origin = str(path)
    for key in KIND_ONLY_FIELDS:
        raw.pop(key, None)
    fields = _checked(raw, DEVICE_FIELDS, origin)
    missing = [k for k in DEVICE_FIELDS if k not in fields and k not in _OPTIONAL]
    if missing:
        fail(missing[0], None, origin, "missing", f"add '{missing[0]}:' with its source")
    if fields["kind"] != path.stem:
        fail("kind", fields["kind"], origin, f"differs from the file name {path.stem!r}",
             f"write kind: {path.stem}")
    return fields, path


def gpu_target(kind: str) -> dict | None:
    """The `gpu_target:` figures of configs/devices/KIND.yaml (GPU_TARGET_FIELDS, each checked,
    compute_capability as (major, minor, "a" or "")) plus its `device_name`; None when the file
    has no gpu_target. ConfigError for an unknown kind or a bad figure."""
    raw, path = _kind_file(kind)
    target, origin = raw.get("gpu_target"), str(path)
    if target is None:
        return None
    if not isinstance(target, dict):
        fail("gpu_target", target, origin, "must be a mapping",
             f"indent its keys {', '.join(GPU_TARGET_FIELDS)} under it")
    out = {}
    for key, tp in GPU_TARGET_FIELDS.items():
        value = target.get(key)
        ok = isinstance(value, int | float if tp is float else tp) and not isinstance(value, bool)
        if not ok or (tp is not str and value <= 0):
            fail(f"gpu_target.{key}", value, origin, f"must be a positive {tp.__name__}",
                 "write the figure the CUDA runtime reports, with its source")
        out[key] = value
    unknown = sorted(set(target) - set(GPU_TARGET_FIELDS))
    if unknown:
        fail(f"gpu_target.{unknown[0]}", target[unknown[0]], origin, "unknown key",
             f"use one of {', '.join(GPU_TARGET_FIELDS)}")
    match = _CAPABILITY.fullmatch(out["compute_capability"])
    if match is None:
        fail("gpu_target.compute_capability", out["compute_capability"], origin,
             "is not MAJOR.MINOR[a]", "write e.g. '9.0a'")
    out["compute_capability"] = (int(match.group(1)), int(match.group(2)), match.group(3))
    if not isinstance(raw.get("device_name"), str):
        fail("device_name", raw.get("device_name"), origin, "missing (a gpu_target needs it)",
             "add jax's device_kind of this GPU, e.g. device_name: \"NVIDIA H100 80GB HBM3\"")
    out["device_name"] = raw["device_name"]
    return out


def _check_sources(given: dict, origin: str) -> None:
    """A kernel-efficiency figure and its `_source` come together in `given` (a kind file's
    fields or a cluster file's overrides); ConfigError naming the missing one otherwise."""
    for key in EFFICIENCY_FIELDS:
        source = f"{key}_source"
        if (key in given) != (source in given):
            missing, present = (key, source) if key not in given else (source, key)
            fail(missing, None, origin, f"missing beside {present}",
                 f"give {key} and {source} together (the figure and where it was published)")


def _build(name: str, devices: int, kind: str, overrides: dict, where: str,
           cluster_file: str = "") -> Cluster:
    """The cluster of `devices` devices of `kind` with `overrides` (from `cluster_file`, if
    any) on top; `where` names the spec or file in errors."""
    fields, kind_path = load_device_kind(kind)
    fields.update(overrides)
    per_host = fields["devices_per_host"]
    if devices % per_host and per_host % devices:
        raise ConfigError(f"{where}: {devices} devices of kind {kind!r} is not a multiple of its "
                          f"devices_per_host={per_host} (nor a part of one host); use a multiple "
                          f"of {per_host}")
    origin = f"{cluster_file} + {kind_path}" if cluster_file else str(kind_path)
    _check_sources(overrides, origin)  # a cluster file's own figures, then the merged ones
    _check_sources(fields, origin)
    return Cluster(name=name, devices=devices, origin=origin, **fields)


def _load_file(path: Path) -> Cluster:
    origin = str(path)
    if path.resolve().parent.name == "mesh":
        _mesh_error(origin)
    raw = _checked(_read(path), CLUSTER_FIELDS, origin)
    for key in ("kind", "devices"):
        if key not in raw:
            fail(key, None, origin, "missing", "a cluster file needs 'kind:' and 'devices:'")
    kind, devices = raw.pop("kind"), raw.pop("devices")
    if _find("devices", kind) is None:
        fail("kind", kind, origin, "unknown device kind", f"use one of {', '.join(known_kinds())}")
    return _build(path.stem, devices, kind, raw, f"cluster file {origin!r}", origin)


def _from_count(spec: str, count: int, kind: str) -> Cluster:
    if count < 1:
        raise ConfigError(f"--cluster {spec!r}: device count {count} must be at least 1; "
                          f"write e.g. 8x{kind}")
    if _find("devices", kind) is None:
        raise ConfigError(f"--cluster {spec!r}: unknown device kind {kind!r}; use one of "
                          f"{', '.join(known_kinds())}")
    return _build(spec, count, kind, {}, f"--cluster {spec!r}")


def load_cluster(spec: str) -> Cluster:
    """The cluster `spec` names: a path to a cluster file, a name under configs/cluster/ (with
    or without .yaml; the current directory's configs/ first, then the package's), or
    COUNTxKIND built from configs/devices/KIND.yaml. Raises ConfigError naming what is wrong."""
    path = Path(spec)
    is_path = "/" in spec or path.suffix in (".yaml", ".yml")
    if is_path and path.is_file():
        return _load_file(path)
    if is_path and not path.is_absolute() and (PACKAGE_CONFIGS.parent / path).is_file():
        return _load_file(PACKAGE_CONFIGS.parent / path)  # configs/... from another directory
    if not is_path or path.parent == Path("."):
        found = _find("cluster", path.name)
        if found is not None:
            return _load_file(found)
        if _find("mesh", path.name) is not None:
            _mesh_error(spec)
    match = _SPEC.fullmatch(spec)
    if match:
        return _from_count(spec, int(match.group(1)), match.group(2).lower())
    if is_path:
        raise ConfigError(f"--cluster {spec!r}: file not found; pass {_FORMS}")
    if re.search(r"\d", spec):
        raise ConfigError(f"--cluster {spec!r}: neither a cluster under configs/cluster/ nor of "
                          f"the form COUNTxKIND; write e.g. 2048xh800 (kinds: "
                          f"{', '.join(known_kinds())})")
    raise ConfigError(f"--cluster {spec!r}: no such cluster; use one of "
                      f"{', '.join(known_clusters())}, or COUNTxKIND with a kind from "
                      f"{', '.join(known_kinds())}")


def kind_slug(device_kind: str) -> str:
    """"NVIDIA L40S" -> "nvidia_l40s": the file name an unknown kind needs."""
    return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")


def kind_named(device_name: str) -> str | None:
    """The configs/devices/ kind whose `device_name` is jax's device_kind `device_name`, else the
    file named after its slug, else None."""
    for kind in known_kinds():
        raw, _ = _kind_file(kind)
        if raw.get("device_name") == device_name:
            return kind
    slug = kind_slug(device_name)
    return slug if slug in known_kinds() else None


def device_kind() -> tuple[str, str | None]:
    """(jax's device_kind of this job's devices, its configs/devices/ name or None)."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return device.device_kind, "cpu"
    return device.device_kind, kind_named(device.device_kind)
