#!/usr/bin/env bash
# One-call GPU check for a lent H200 (issue 8): run from the repo root on the device machine.
#   run(command="bash tools/gpu_check.sh", timeout_s=540)
# Writes every figure to $OUT (or ./gpu_out). JAX/flax/optax/orbax/chex are preinstalled there;
# the rest of maxmoe's pure-Python deps install from wheels carried in shared/wheels if present.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
pip install --no-deps -e . >/dev/null 2>&1
[ -d shared/wheels ] && pip install --no-index --find-links shared/wheels pyyaml tqdm sentencepiece grain safetensors >/dev/null 2>&1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python -c "import jax; print(jax.devices())" > "$OUT/devices.txt" 2>&1
timeout 150 python tools/bench_grouped_matmul.py --tokens 32768 --dim 1024 --ffn 512 --experts 64 --topk 6 --dtype bfloat16 > "$OUT/grouped_matmul.txt" 2>&1
timeout 240 python -m maxmoe.cli bench configs/bench/h200_deepseek_1b.yaml --steps 10 --profile /tmp/maxmoe_trace > "$OUT/bench_h200.json" 2> "$OUT/bench_h200.log"
timeout 120 python -m maxmoe.cli bench configs/bench/h200_deepseek_1b.yaml attention.kind=gqa attention.num_kv_heads=16 attention.head_dim=64 attention.implementation=fused --steps 10 > "$OUT/bench_h200_gqa_fused.json" 2> "$OUT/bench_h200_gqa_fused.log"
tail -n 3 "$OUT"/*.txt "$OUT"/*.json
