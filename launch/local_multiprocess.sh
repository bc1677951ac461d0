#!/usr/bin/env bash
# Runs N maxmoe processes on this machine as one multi-process JAX job (for testing, and
# for a first try of multi-host training on one box). Every process runs the same command;
# process 0 hosts the coordinator and writes logs, metrics and the config.
#
#   launch/local_multiprocess.sh 2 train configs/tiny.yaml mesh.cpu_devices=4 mesh.dcn_data=2
#
# N: processes. On CPU give each process its devices with mesh.cpu_devices=K (the global mesh
# then has N*K devices). On a multi-GPU box each process sees all GPUs unless you restrict
# them (CUDA_VISIBLE_DEVICES per process is not set here).
# Env: PYTHON (the interpreter that has maxmoe installed; default: python3 on PATH),
# MAXMOE_COORDINATOR_PORT (default: a free port), MAXMOE_LOG_DIR (default: no per-process
# log files; process i>0 output goes to $MAXMOE_LOG_DIR/process_i.log when set).
# Exit code: the first non-zero exit code of any process (75 = preempted by SIGTERM after a
# save; run again to resume), else 0; each non-zero exit is reported on stderr as
# "process I exited with code C". SIGTERM/SIGINT to this script is forwarded to all.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '2,16p' "$0"
  exit 2
fi
num_processes=$1
shift
python=${PYTHON:-python3}
port=${MAXMOE_COORDINATOR_PORT:-$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

pids=()
forward() { for pid in "${pids[@]}"; do kill -s "$1" "$pid" 2>/dev/null || true; done; }
trap 'forward TERM' TERM
trap 'forward INT' INT

for ((i = 0; i < num_processes; i++)); do
  export MAXMOE_COORDINATOR=127.0.0.1:$port MAXMOE_NUM_PROCESSES=$num_processes MAXMOE_PROCESS_ID=$i
  if [[ -n "${MAXMOE_LOG_DIR:-}" && $i -gt 0 ]]; then
    mkdir -p "$MAXMOE_LOG_DIR"
    "$python" -m maxmoe.cli "$@" >"$MAXMOE_LOG_DIR/process_$i.log" 2>&1 &
  else
    "$python" -m maxmoe.cli "$@" &
  fi
  pids+=($!)
done

status=0
for i in "${!pids[@]}"; do
  pid=${pids[$i]}
  # `wait` returns early when a trapped signal arrives: wait again until the process is gone
  while true; do
    set +e
    wait "$pid"
    code=$?
    set -e
    kill -0 "$pid" 2>/dev/null || break
  done
  if [[ $code -ne 0 ]]; then
    case $code in
      75) why=" (saved after SIGTERM; run again to resume)" ;;
      134) why=" (aborted: JAX found a dead or unreachable process, see the lines above)" ;;
      137) why=" (killed by SIGKILL)" ;;
      *) why="" ;;
    esac
    echo "local_multiprocess.sh: process $i exited with code $code$why" >&2
    if [[ $status -eq 0 ]]; then status=$code; fi
  fi
done
exit $status
