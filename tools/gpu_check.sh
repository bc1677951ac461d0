#!/usr/bin/env bash
# One-call GPU check for a lent H200 (issue 8): run from the repo root on the device machine.
#   run(command="bash tools/gpu_check.sh", timeout_s=540)
# Writes every figure to $OUT (or ./gpu_out). Nothing is installed: the device image has JAX,
# flax, optax, orbax, chex, pyyaml, tqdm, sentencepiece and safetensors, but not grain, which
# `maxmoe bench` does not import (synthetic batches; tests/test_bench.py checks that), and its
# pip cannot build an editable install offline, so the checkout goes on PYTHONPATH instead.
# Dry run on a CPU at toy shapes, to check the script itself before spending device minutes:
#   GPU_CHECK_DRY=1 bash tools/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
PY=${PY:-python3}  # the image's python3 holds JAX; a plain `python` may not exist there
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
GM="--tokens 32768 --dim 1024 --ffn 512 --experts 64 --topk 6 --dtype bfloat16"
SHRINK=()
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
  GM="--tokens 1024 --dim 64 --ffn 32 --experts 8 --topk 2 --dtype bfloat16"
  SHRINK=(model.num_layers=2 model.hidden_size=128 model.vocab_size=1024 model.dense_mlp_size=256
          moe.num_experts=16 moe.expert_mlp_size=64 data.seq_len=256 data.global_batch_size=2)
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())" > "$OUT/devices.txt" 2>&1
timeout 150 $PY tools/bench_grouped_matmul.py $GM > "$OUT/grouped_matmul.txt" 2>&1
timeout 240 $PY -m maxmoe.cli bench configs/bench/h200_deepseek_1b.yaml "${SHRINK[@]}" --steps 10 \
  --profile /tmp/maxmoe_trace > "$OUT/bench_h200.json" 2> "$OUT/bench_h200.log"
timeout 120 $PY -m maxmoe.cli bench configs/bench/h200_deepseek_1b.yaml "${SHRINK[@]}" attention.kind=gqa \
  attention.num_kv_heads=16 attention.head_dim=64 attention.implementation=fused --steps 10 \
  > "$OUT/bench_h200_gqa_fused.json" 2> "$OUT/bench_h200_gqa_fused.log"
tail -n 3 "$OUT"/*.txt "$OUT"/*.json
tail -n 25 "$OUT/bench_h200.log"
