"""Config <-> YAML: presets merged in order, then dotted overrides, every key and type checked.

`load_config(["a.yaml", "b.yaml"], ["train.steps=10"])` merges the files in order, then the
overrides, checks every key and type, and returns a `Config` with each key's origin;
`save_config` writes the resolved config a run and a checkpoint keep.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import yaml

from maxmoe.config import DEFAULT_RULES, Config, ConfigError, fail


def _merge(dst: dict, src: dict, origins: dict[str, str], origin: str, prefix: str = "") -> None:
    for k, v in src.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):  # recurse so every leaf key records where it came from
            if not isinstance(dst.get(k), dict):
                dst[k] = {}
            origins.setdefault(key, origin)
            _merge(dst[k], v, origins, origin, key + ".")
        else:
            dst[k] = v
            origins[key] = origin


def _check_type(key: str, value: Any, tp: Any, origin: str) -> Any:
    """Returns value converted to tp where that is lossless (int -> float), else fails."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            fail(key, value, origin, f"expected {tp.__name__}, got {type(value).__name__}",
                  f"write a value of type {tp.__name__}")
        return value
    if typing.get_origin(tp) is list:
        if not isinstance(value, list) or not all(type(v) is int for v in value):
            fail(key, value, origin, "expected a list of integers", "write e.g. [0, 5]")
        return list(value)
    if typing.get_origin(tp) is dict:
        if not isinstance(value, dict) or not all(
                isinstance(v, list) and all(isinstance(a, str) for a in v) for v in value.values()):
            fail(key, value, origin, "expected a mapping of logical axis -> list of mesh axes",
                  "write e.g. {batch: [data, fsdp]}")
        # a rules mapping overrides the default table per logical axis
        return {**{k: list(v) for k, v in DEFAULT_RULES.items()},
                **{k: list(v) for k, v in value.items()}}
    raise TypeError(f"unsupported config field type {tp} at {key}")  # a bug, not a user error


def _build(cls: type, raw: dict, origins: dict[str, str], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in raw:
        if k not in names:
            key = f"{prefix}{k}"
            fail(key, raw[k], origins.get(key, "?"), "unknown key",
                  f"valid keys under '{prefix[:-1] or 'top level'}' are: {', '.join(sorted(names))}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        key, tp = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(raw[f.name], dict):
                fail(key, raw[f.name], origins.get(key, "?"), "expected a section (mapping)",
                      f"nest its keys under '{key}:'")
            kwargs[f.name] = _build(tp, raw[f.name], origins, key + ".")
        else:
            kwargs[f.name] = _check_type(key, raw[f.name], tp, origins.get(key, "?"))
    return cls(**kwargs)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} (from command line): expected key.sub=value; "
                          "write e.g. train.steps=100")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""


def load_config(paths: list[str], overrides: list[str] = ()) -> tuple[Config, dict[str, str]]:
    """Merges YAML presets then dotted overrides. Returns the config and key -> origin."""
    raw: dict = {}
    origins: dict[str, str] = {}
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ConfigError(f"config file {p!r}: not found; pass the path of an existing YAML file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p!r}: not valid YAML ({str(e).splitlines()[0]}); "
                              "fix the syntax") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p!r}: top level must be a mapping of sections; "
                              "write e.g. 'train:\\n  steps: 100'")
        _merge(raw, data, origins, p)
    for text in overrides:
        keys, value = _parse_override(text)
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        _merge(raw, nested, origins, "command line")
    cfg = _build(Config, raw, origins)
    if not cfg.run.dir:
        name = cfg.run.name or (Path(paths[-1]).stem if paths else "default")
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(Path("runs") / name)))
    return cfg, origins


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
