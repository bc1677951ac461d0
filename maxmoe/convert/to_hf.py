"""maxmoe params -> Hugging Face config.json + safetensors with hub names, tensor by tensor.

Hub tensors are written grouped by the maxmoe params they come from (so a shard lists them by
param, not layer by layer), and only those params are restored at a time (a training run
directory is restored whole): the peak is the largest param (all layers of one stacked kernel)
plus one hub tensor, not the model.
"""

from __future__ import annotations

import json
from pathlib import Path

from maxmoe.convert.checkpoint_io import read_converted, read_params
from maxmoe.hf.config import config_to_hf, family_for
from maxmoe.hf.names import hub_shape, hub_tensors, mtp_shared_copies, params_to_hub
from maxmoe.hf.safetensors_io import write_safetensors
from maxmoe.model.transformer import abstract_params

HF_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def convert_to_hf(ckpt_dir: Path, out_dir: Path, dtype: str | None = None,
                  max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Writes OUT_DIR/config.json and the safetensors shards; returns the shard paths.

    Each tensor keeps the dtype it had in the source hub checkpoint (recorded by from-hf), else
    `dtype` (default bfloat16); the DeepSeek router bias stays float32 as in the hub files.
    """
    cfg, base, source_dtypes = read_converted(ckpt_dir)
    family = family_for(cfg)
    default = HF_DTYPES[dtype or (base or {}).get("dtype") or (base or {}).get("torch_dtype")
                        or "bfloat16"]
    if dtype:
        source_dtypes = {}
    shapes = abstract_params(cfg)
    tensors = {t.name: t for t in hub_tensors(cfg, family) + mtp_shared_copies(cfg)}

    def dtype_of(name: str) -> str:
        if name in source_dtypes and source_dtypes[name] in ("F32", "BF16", "F16"):
            return source_dtypes[name]
        return "F32" if name.endswith("e_score_correction_bias") else default

    groups: dict[tuple, list[str]] = {}  # param paths -> the hub tensors made from them
    for name, t in tensors.items():
        groups.setdefault(tuple(dict.fromkeys(p.path for p in t.parts)), []).append(name)
    paths_of = {name: paths for paths, names in groups.items() for name in names}
    plan = [(name, hub_shape(tensors[name], shapes), dtype_of(name))
            for names in groups.values() for name in names]
    whole = not (Path(ckpt_dir) / "params").is_dir()  # a run directory: restore it once
    loaded: dict[tuple, dict] = {}

    def produce(name: str):
        paths = () if whole else paths_of[name]
        if paths not in loaded:
            loaded.clear()  # free the previous group first
            loaded[paths] = read_params(ckpt_dir, cfg, None if whole else list(paths))
        return params_to_hub(tensors[name], loaded[paths])

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name_of_dtype = {v: k for k, v in HF_DTYPES.items()}
    hf = config_to_hf(cfg, base, name_of_dtype[default])
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    return write_safetensors(out_dir, plan, produce, max_shard_bytes)
