"""FP8 training and export (issue 28, bad input): an FP8-trained run keeps float32 master
weights, so `convert to-hf` exports it in BF16 like any run. (A BF16 checkpoint resuming in FP8:
tests/kernels/test_fp8.py::test_bf16_checkpoint_resumes_in_fp8.)"""

import json

import jax
import ml_dtypes
import numpy as np
import pytest

from maxmoe.cli import main
from maxmoe.config_files import load_config
from maxmoe.convert.checkpoint_io import read_params
from maxmoe.hf.config import family_for
from maxmoe.hf.names import hub_tensors, params_to_hub
from maxmoe.hf.safetensors_io import SafetensorsReader
from maxmoe.train.loop import train
from maxmoe.validation import validate

# the tiny DeepSeek-V3 (a hub family: deepseek_v3), cut to 1 dense + 1 MoE layer and its MTP
# depth, on 8 data-parallel fake devices
FILES = ["configs/tiny.yaml", "configs/models/tiny_deepseek_v3.yaml"]
COMMON = ["model.num_layers=2", "precision.compute_dtype=bfloat16", "mesh.data=-1",
          "mesh.fsdp=1", "mesh.expert=1", "data.seq_len=64", "data.global_batch_size=8",
          "optimizer.warmup_steps=1", "checkpoint.every_steps=2", "logging.every_steps=1",
          "logging.progress_bar=false", "checkpoint.async_save=false",
          "train.eval_every_steps=0"]


def _train(run_dir, steps: int, fp8: str) -> dict:
    cfg, origins = load_config(FILES, [*COMMON, f"train.steps={steps}", f"precision.fp8={fp8}",
                                       f"run.dir={run_dir}"])
    return train(cfg, validate(cfg, jax.device_count(), origins))


@pytest.mark.slow
def test_fp8_run_exports_bf16(tmp_path, capsys):
    fp8_run = tmp_path / "fp8"
    _train(fp8_run, 2, "blockwise")
    cfg, _ = load_config([str(fp8_run / "config.yaml")])
    assert cfg.precision.fp8 == "blockwise"
    params = read_params(fp8_run, cfg)
    assert {a.dtype for a in jax.tree.leaves(params)} == {np.dtype(np.float32)}  # master weights
    assert main(["convert", "to-hf", str(fp8_run), str(tmp_path / "hf")]) == 0
    reader = SafetensorsReader(tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["dtype"] == "bfloat16" and "quantization_config" not in hf  # not an FP8 checkpoint
    for tensor in hub_tensors(cfg, family_for(cfg)):
        got = np.array(reader.raw(tensor.name))
        # the float32 master weight rounded to bf16, bit for bit (DeepSeek's router bias stays
        # float32, as in the hub files)
        dtype = np.float32 if tensor.name.endswith("e_score_correction_bias") else ml_dtypes.bfloat16
        want = params_to_hub(tensor, params).astype(dtype)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), tensor.name
    capsys.readouterr()
