#!/usr/bin/env bash
# One-call GPU check for a lent NVIDIA GPU (H100 or H200): run from the repo root on the device.
#   bash tools/gpu_wheels.sh    # here, once: tokamax & co., grain & co. into .whl/ (~41 MB)
#   run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Stages, most important first, each with its own allowance (all within 525 s):
#   0. the carried wheels; whether tokamax imports on the image's own jax        (tokamax.txt)
#   1. the kernels `auto` picks on NVIDIA GPUs (tokamax's Mosaic grouped GEMM and flash
#      attention) on the device against float32 references on the host (tools/
#      check_gpu_kernels.py)                                                 90 s (kernels.txt)
#   2. tokens/s, MFU and profile of the DeepSeek-shaped 1.3B bench config with the auto
#      kernels, then with the old ones (lax.ragged_dot, cuDNN attention)    150 s + 110 s
#   3. the earlier stages with what is left: a short training run, the grouped GEMM alone,
#      FP8, optimizer offload, planned vs measured, the all-to-all transports
# The device returns at most 8 files, so every figure goes to a work folder that is packed
# into $OUT/gpu_check.tgz after each stage (a call cut short keeps what was done); the last
# lines printed are the headline figures. The image has JAX, flax, optax, orbax, chex, pyyaml,
# tqdm, sentencepiece and safetensors; its pip cannot build an editable install offline, so
# the checkout goes on PYTHONPATH. Dry run on this CPU at toy shapes, to check the script
# before spending device minutes (stage 1 then runs jax.lax's kernels in tokamax's place):
#   GPU_CHECK_DRY=1 bash tools/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
W=/tmp/gpu_check; rm -rf "$W"; mkdir -p "$W"
save() { tar czf "$OUT/gpu_check.tgz" -C "$W" . 2> /dev/null; }
left() { local t=$(( 525 - SECONDS )); [ "$t" -gt "$1" ] && t=$1; echo $(( t > 5 ? t : 5 )); }
PY=${PY:-python3}  # the image's python3 holds JAX; a plain `python` may not exist there
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MAXMOE_CACHE=/tmp/maxmoe_cache
CFG=configs/bench/h200_deepseek_1b.yaml
OLD=(moe.grouped_matmul=ragged_dot attention.implementation=fused)
GM="--tokens 32768 --dim 1024 --ffn 512 --experts 64 --topk 6 --dtype bfloat16"
A2A="--tokens 4096 --dim 1024 --ffn 512 --experts 64 --topk 6"
KERNELS=(--kernel tokamax)
SHRINK=()
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
  SHRINK=(model.num_layers=2 model.hidden_size=128 model.vocab_size=1024 model.dense_mlp_size=256
          moe.num_experts=16 moe.expert_mlp_size=64 data.seq_len=256 data.global_batch_size=2)
  OLD=(moe.grouped_matmul=ragged_dot attention.implementation=einsum)
  GM="--tokens 1024 --dim 64 --ffn 32 --experts 8 --topk 2 --dtype bfloat16"
  A2A="--tokens 256 --dim 64 --ffn 32 --experts 8 --topk 2"
  KERNELS=(--kernel lax --rows 512 --dim 128 --ffn 64 --experts 8 --seq 256 --heads 2)
elif compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$W/wheels.txt" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi > "$W/nvidia-smi.txt" 2>&1
# 0. the planner's prediction of this config on one H200 (XLA:CPU stand-ins), compiled on
#    fake CPU devices in the background at the lowest priority, on the last 4 cores where
#    taskset exists, so it costs the call nothing; read in stage 3
PLAN_CPUS=()
if command -v taskset > /dev/null && [ "$(nproc)" -gt 4 ]; then
  PLAN_CPUS=(taskset -c "$(( $(nproc) - 4 ))-$(( $(nproc) - 1 ))")
fi
JAX_PLATFORMS=cpu timeout 400 nice -n 19 "${PLAN_CPUS[@]}" $PY -m maxmoe.cli plan $CFG \
  "${SHRINK[@]}" --cluster 1xh200 --compiler cpu > "$W/plan_1xh200.txt" 2> "$W/plan_1xh200.log" &
PLAN_PID=$!
timeout 60 $PY -c "import jax, flax, tokamax; print(jax.__version__, flax.__version__, \
jax.devices(), 'tokamax', tokamax.__version__)" > "$W/tokamax.txt" 2>&1
save
# 1. the kernels, forward and both gradients, against float32 on the host (pass/fail per row)
timeout 90 $PY tools/check_gpu_kernels.py "${KERNELS[@]}" > "$W/kernels.txt" 2>&1
save
# 2. the auto kernels, then the old ones (ragged_dot: XLA's dense expansion; fused: cuDNN with
#    v padded 64 -> 96); if the auto run fails, stage 3 runs the old kernels
USE=()
timeout 150 $PY -m maxmoe.cli bench $CFG "${SHRINK[@]}" --steps 10 --profile /tmp/maxmoe_trace \
  > "$W/bench_auto.json" 2> "$W/bench_auto.log"
grep -q tokens_per_second "$W/bench_auto.json" || USE=("${OLD[@]}")
save
timeout "$(left 110)" $PY -m maxmoe.cli bench $CFG "${SHRINK[@]}" "${OLD[@]}" --steps 10 \
  > "$W/bench_old.json" 2> "$W/bench_old.log"
save
# 3a. a short real training run (stdlib-sources corpus, its own tokenizer): the loss goes down;
#     no checkpoint (1.3B's params and AdamW moments are 15.6 GB to write); a fresh run dir.
#     Its records carry peak_memory_bytes (memory_stats) and its plan.json the GPU's compile
rm -rf /tmp/maxmoe_gpu_run
timeout "$(left 100)" $PY -m maxmoe.cli train $CFG "${SHRINK[@]}" "${USE[@]}" train.steps=30 \
  logging.every_steps=5 checkpoint.enabled=false run.dir=/tmp/maxmoe_gpu_run \
  > "$W/train.json" 2> "$W/train.log"
for f in metrics.jsonl events.jsonl plan.json; do cp "/tmp/maxmoe_gpu_run/$f" "$W/train_$f" 2>/dev/null; done
save
# 3b. the grouped GEMM alone against a dense matmul of the same FLOPs (its ceiling)
timeout "$(left 60)" $PY tools/bench_grouped_matmul.py $GM > "$W/grouped_matmul.txt" 2>&1
save
# 3c. FP8 (precision.fp8 none, tensorwise, blockwise compiled in one process, timed in turns:
#     step time, tokens/s, MFU per matmul class), then the HLO evidence of FP8 GEMMs
if [ "$SECONDS" -lt 400 ]; then
  timeout "$(left 120)" $PY -m maxmoe.cli bench $CFG "${SHRINK[@]}" "${USE[@]}" --steps 5 \
    --warmup 2 --sweep precision.fp8=none,tensorwise,blockwise > "$W/bench_fp8.json" \
    2> "$W/bench_fp8.log"
  timeout "$(left 45)" $PY tools/fp8_hlo.py kernels > "$W/fp8_hlo_kernels.txt" 2>&1
  save
fi
# 3d. optimizer.offload_state: the device's own peak with the Adam moments on the device and in
#     pinned host memory (XLA:CPU places no memory kinds); one process each
for OFFLOAD in false true; do
  if [ "$SECONDS" -lt 450 ]; then
    timeout $(( (515 - SECONDS) / 2 )) $PY -m maxmoe.cli bench $CFG "${SHRINK[@]}" "${USE[@]}" \
      --steps 3 --warmup 1 optimizer.offload_state=$OFFLOAD > "$W/offload_state_$OFFLOAD.json" \
      2> "$W/offload_state_$OFFLOAD.log"
  fi
done
# 3e. planned (XLA:CPU stand-ins) against measured: stage 2's bench and 3a's plan.json
wait "$PLAN_PID"  # its own timeout: 400 s from the start
BENCH_JSON=$(grep -l tokens_per_second "$W"/bench_auto.json "$W"/bench_old.json 2>/dev/null | head -n 1)
timeout "$(left 20)" $PY tools/plan_vs_measured.py "$W/plan_1xh200.txt" \
  "${BENCH_JSON:-$W/bench_auto.json}" --train-plan "$W/train_plan.json" > "$W/plan_vs_measured.txt" 2>&1
save
# 3f. the all-to-all and two-level transports' kernels alone, only with the time left
if [ "$SECONDS" -lt 480 ]; then
  timeout "$(left 40)" $PY tools/check_all_to_all.py $A2A > "$W/all_to_all.txt" 2>&1
fi
if [ "$SECONDS" -lt 500 ]; then
  timeout "$(left 25)" $PY tools/check_all_to_all.py $A2A --transport two_level \
    > "$W/two_level.txt" 2>&1
fi
save
# the headline figures, printed last (the call returns the last 12,000 characters)
cat "$W/tokamax.txt" "$W/kernels.txt"
for f in bench_auto bench_old; do
  echo "== $f: $(tail -n 4 "$W/$f.log" | tr '\n' ' ')"
  $PY -c "import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); \
print({k: r.get(k) for k in ('tokens_per_second','mfu','step_time_s','peak_bytes','temp_bytes')})" \
    "$W/$f.json" 2> /dev/null
done
tail -n 2 "$W/train.json" "$W/grouped_matmul.txt" "$W/plan_vs_measured.txt" 2> /dev/null
grep -A3 "^precision.fp8" "$W/bench_fp8.log" 2> /dev/null
echo "seconds: $SECONDS"
