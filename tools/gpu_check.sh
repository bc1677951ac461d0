#!/usr/bin/env bash
# One-call GPU check for a lent H200 (issue 8): run from the repo root on the device machine.
#   bash tools/gpu_wheels.sh    # here, once: grain & co. for the short training run, into .whl/
#   run(command="bash tools/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Writes every figure to $OUT (or ./gpu_out), most important first, each step with its own
# timeout (all together < 540 s). Nothing is fetched: the device image has JAX, flax, optax,
# orbax, chex, pyyaml, tqdm, sentencepiece and safetensors but not grain, which `maxmoe bench`
# does not import (synthetic batches; tests/test_bench.py checks that) and `maxmoe train` does
# (installed from the carried .whl/ when there). Its pip cannot build an editable install
# offline, so the checkout goes on PYTHONPATH instead.
# Dry run on a CPU at toy shapes, to check the script itself before spending device minutes:
#   GPU_CHECK_DRY=1 bash tools/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
PY=${PY:-python3}  # the image's python3 holds JAX; a plain `python` may not exist there
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MAXMOE_CACHE=/tmp/maxmoe_cache
CFG=configs/bench/h200_deepseek_1b.yaml
GM="--tokens 32768 --dim 1024 --ffn 512 --experts 64 --topk 6 --dtype bfloat16"
SHRINK=()
if [ "${GPU_CHECK_DRY:-0}" = 1 ]; then
  GM="--tokens 1024 --dim 64 --ffn 32 --experts 8 --topk 2 --dtype bfloat16"
  SHRINK=(model.num_layers=2 model.hidden_size=128 model.vocab_size=1024 model.dense_mlp_size=256
          moe.num_experts=16 moe.expert_mlp_size=64 data.seq_len=256 data.global_batch_size=2)
elif compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$OUT/wheels.txt" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
# 5, started first, read last: the planner's prediction of this config on one H200, compiled
#    on fake CPU devices in the background while the GPU stages run (CPU only, lowest priority,
#    on the last 4 cores where taskset exists), so it costs the 540 s nothing
PLAN_CPUS=()
if command -v taskset > /dev/null && [ "$(nproc)" -gt 4 ]; then
  PLAN_CPUS=(taskset -c "$(( $(nproc) - 4 ))-$(( $(nproc) - 1 ))")
fi
JAX_PLATFORMS=cpu timeout 400 nice -n 19 "${PLAN_CPUS[@]}" $PY -m maxmoe.cli plan $CFG "${SHRINK[@]}" \
  --cluster 1xh200 > "$OUT/plan_1xh200.txt" 2> "$OUT/plan_1xh200.log" &
PLAN_PID=$!
$PY -c "import jax, flax; print(jax.__version__, flax.__version__, jax.devices())" > "$OUT/devices.txt" 2>&1
# 1. the reference figures: tokens/s, step time, MFU against 989 TFLOP/s, profile breakdown,
#    with cuDNN flash attention (MLA's v padded to q.k's head dim); if cuDNN refuses it, the
#    XLA query-block attention instead, and the training run below uses whichever ran
ATTN=attention.implementation=fused
timeout 190 $PY -m maxmoe.cli bench $CFG "${SHRINK[@]}" --steps 10 --profile /tmp/maxmoe_trace \
  > "$OUT/bench_h200.json" 2> "$OUT/bench_h200.log"
if ! grep -q tokens_per_second "$OUT/bench_h200.json"; then
  ATTN=attention.implementation=einsum
  timeout 130 $PY -m maxmoe.cli bench $CFG "${SHRINK[@]}" $ATTN --steps 10 \
    > "$OUT/bench_h200_einsum.json" 2> "$OUT/bench_h200_einsum.log"
fi
# 1b. FP8 (issue 28): the same config in bf16, tensorwise and blockwise, compiled in one
#     process and timed in turns (one shared state): step time, tokens/s, MFU per matmul class
#     (metrics/flops.py) and against the bf16 and the fp8 peak alone (mfu_vs_*_peak); then the
#     HLO evidence that the FP8 GEMMs run as FP8 (tools/fp8_hlo.py: cuBLASLt f8 custom calls,
#     f8e4m3 dots), for fp8_dot / fp8_ragged_dot alone and for the train step of each mode.
#     Allowance: 240 s of bench (three compiles), 45 s of kernels; the step compiles (two more)
#     only with time left, since the bench's own timings come first
timeout 240 $PY -m maxmoe.cli bench $CFG "${SHRINK[@]}" $ATTN --steps 5 --warmup 2 \
  --sweep precision.fp8=none,tensorwise,blockwise > "$OUT/bench_fp8.json" 2> "$OUT/bench_fp8.log"
timeout 45 $PY tools/fp8_hlo.py kernels > "$OUT/fp8_hlo_kernels.txt" 2>&1
if [ "$SECONDS" -lt 300 ]; then
  timeout $(( 420 - SECONDS )) $PY tools/fp8_hlo.py step $CFG "${SHRINK[@]}" $ATTN \
    > "$OUT/fp8_hlo_step.txt" 2>&1
fi
# the fixed stages below get what is left of the call, at most their own allowance
left() { local t=$(( 525 - SECONDS )); [ "$t" -gt "$1" ] && t=$1; echo $(( t > 5 ? t : 5 )); }
# 2. the grouped matmul alone against a dense matmul of the same FLOPs (its ceiling)
timeout "$(left 90)" $PY tools/bench_grouped_matmul.py $GM > "$OUT/grouped_matmul.txt" 2>&1
# 3. a short real training run (stdlib-sources corpus, its own tokenizer): the loss goes down;
#    no checkpoint (the params and AdamW moments of 1.3B are 15.6 GB to write); a fresh run
#    dir, so that a second call (or dry run) does not append to the first one's metrics
rm -rf /tmp/maxmoe_h200_run
timeout "$(left 110)" $PY -m maxmoe.cli train $CFG "${SHRINK[@]}" $ATTN train.steps=30 logging.every_steps=5 \
  checkpoint.enabled=false \
  run.dir=/tmp/maxmoe_h200_run > "$OUT/train.json" 2> "$OUT/train.log"
# its records carry peak_memory_bytes (memory_stats, issue 26: absent on CPU) and the
# per-layer arrays; TensorBoard needs tensorboardX on the device image, else the run says so
cp /tmp/maxmoe_h200_run/metrics.jsonl "$OUT/train_metrics.jsonl" 2>/dev/null
cp /tmp/maxmoe_h200_run/events.jsonl "$OUT/train_events.jsonl" 2>/dev/null
cp /tmp/maxmoe_h200_run/plan.json "$OUT/train_plan.json" 2>/dev/null  # the same figures, H200 compile
# 4. optimizer.offload_state: XLA's memory analysis and the device's own peak with the Adam
#    moments on the device and in pinned host memory (XLA:CPU places no memory kinds, so only
#    a GPU shows whether the peak drops); one process each (the device peak never resets),
#    only with the time left of the 540 s call
for OFFLOAD in false true; do
  if [ "$SECONDS" -lt 430 ]; then
    timeout $(( (520 - SECONDS) / 2 )) $PY -m maxmoe.cli bench $CFG "${SHRINK[@]}" $ATTN --steps 3 \
      --warmup 1 optimizer.offload_state=$OFFLOAD > "$OUT/offload_state_$OFFLOAD.json" \
      2> "$OUT/offload_state_$OFFLOAD.log"
  fi
done
# 5. planned (started at the top, done 405 s in at the latest, so the call stays within the
#    540 s) against measured: stage 1's bench (memory_stats' peak_bytes_in_use, median step) and
#    stage 3's plan.json (the H200's own compile). The planner compiles CPU stand-ins (einsum
#    attention, blocked grouped matmul) where the bench ran cuDNN attention and ragged_dot:
#    part of what the ratio shows
wait $PLAN_PID
BENCH_JSON=$(grep -l tokens_per_second "$OUT"/bench_h200*.json 2>/dev/null | head -n 1)
$PY tools/plan_vs_measured.py "$OUT/plan_1xh200.txt" "${BENCH_JSON:-$OUT/bench_h200.json}" \
  --train-plan "$OUT/train_plan.json" > "$OUT/plan_vs_measured.txt" 2>&1
# 6. the all-to-all transport's kernels alone (expert axis of size 1 on one GPU: still a
#    ragged_all_to_all each way) against the all-gather transport, random and worst-case
#    routing; last and only with the time left of the 540 s call
A2A="--tokens 4096 --dim 1024 --ffn 512 --experts 64 --topk 6"
[ "${GPU_CHECK_DRY:-0}" = 1 ] && A2A="--tokens 256 --dim 64 --ffn 32 --experts 8 --topk 2"
if [ "$SECONDS" -lt 470 ]; then
  timeout $(( 530 - SECONDS )) $PY tools/check_all_to_all.py $A2A > "$OUT/all_to_all.txt" 2>&1
fi
# 7. the two-level transport's kernels the same way (one host: hop 1 a ragged_all_to_all over
#    a group of one, hop 2 the rounds), only with the time left
if [ "$SECONDS" -lt 490 ]; then
  timeout $(( 535 - SECONDS )) $PY tools/check_all_to_all.py $A2A --transport two_level \
    > "$OUT/two_level.txt" 2>&1
fi
tail -n 3 "$OUT"/*.txt "$OUT"/*.json
grep -h '"name"' "$OUT"/fp8_hlo_*.txt 2>/dev/null | cut -c1-300
grep -A3 "^precision.fp8" "$OUT/bench_fp8.log" 2>/dev/null
head -n 9 "$OUT/plan_vs_measured.txt"
tail -n 25 "$OUT"/bench_h200*.log
