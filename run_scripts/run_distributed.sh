#!/usr/bin/env bash
# Launch a moetrain job on this node: N msrun workers under moetrain's watchdog
# (python -m moetrain.distributed.launch), which stops the whole job when any rank fails.
#
#   run_scripts/run_distributed.sh --nproc N [--max-restarts R] CONFIG [--set key=value ...] [--resume [DIR]] [--overwrite]
#   (multi-node: add --nnodes K --node-rank R --master-addr A --master-port P; see run_multinode.sh)
#
# Per-rank logs go to <train.output_dir>/logs/worker_<rank>.log (rank 0's is echoed here).
# --max-restarts R: after a rank dies or hangs, relaunch every rank from the last complete checkpoint
#   (the launcher adds --resume), up to R times; logged in <train.output_dir>/logs/restarts.log.
# --hang-timeout S (default 1800), --collective-timeout S (default 300): see docs/faults.md.
# SIGTERM/SIGINT: every rank saves at the next step boundary and the job exits with code 75.
# Environment:
#   MASTER_PORT          scheduler port (default: a free one; required with several nodes)
#   MOETRAIN_ENTRY       command run on every rank before CONFIG (default: python -m moetrain.cli train),
#                        e.g. MOETRAIN_ENTRY="python my_script.py"
#   MOETRAIN_OUTPUT_DIR  output folder to use instead of the config's train.output_dir
#   MOETRAIN_DEVICE      device to use instead of the config's train.device (cpu, ascend, gpu)
#   MOETRAIN_TIMEOUT     kill the job after this many seconds
#   MOETRAIN_COMPILE_CACHE=1  MindSpore compile cache in <train.output_dir>/compile_cache (off by default:
#                        2.10 refuses to cache a jitted function that returns a dict, as the trainer's does)
set -euo pipefail

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; }

NPROC="" NNODES=1 NODE_RANK=0 MASTER_ADDR="127.0.0.1" PORT="${MASTER_PORT:-}" FAULT_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc) NPROC="$2"; shift 2 ;;
    --nnodes) NNODES="$2"; shift 2 ;;
    --node-rank) NODE_RANK="$2"; shift 2 ;;
    --master-addr) MASTER_ADDR="$2"; shift 2 ;;
    --master-port) PORT="$2"; shift 2 ;;
    --max-restarts|--hang-timeout|--collective-timeout|--preempt-grace) FAULT_ARGS+=("$1" "$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --*) echo "run_distributed.sh: unknown option $1 (launcher options go before CONFIG)" >&2; usage >&2; exit 2 ;;
    *) break ;;
  esac
done
if [[ -z "$NPROC" || $# -lt 1 ]]; then
  echo "run_distributed.sh: need --nproc N and a CONFIG" >&2; usage >&2; exit 2
fi
CONFIG="$1"; shift
TRAIN_ARGS=("$@")

# The config is read below as the ranks will read it: parallel.data_parallel, when unset, is
# inferred from this world size (moetrain.config.infer_data_parallel).
export MOETRAIN_WORLD_SIZE=$((NPROC * NNODES))

# The --set overrides, to resolve output_dir and device exactly as the trainer will.
SETS=()
for ((i = 0; i < ${#TRAIN_ARGS[@]}; i++)); do
  if [[ "${TRAIN_ARGS[i]}" == "--set" && $((i + 1)) -lt ${#TRAIN_ARGS[@]} ]]; then
    SETS+=(--set "${TRAIN_ARGS[i + 1]}")
  fi
done

config_value() {  # KEY FALLBACK: the resolved config value, or FALLBACK if moetrain.config is absent
  if python -c "import moetrain.config" 2>/dev/null; then
    python -m moetrain.config "$CONFIG" ${SETS[@]+"${SETS[@]}"} --get "$1"   # on a bad config: prints why, fails
  else
    echo "$2"
  fi
}
# Pre-flight: a config laid out for a device this machine lacks (e.g. Ascend 910B) stops here,
# before any worker starts, with its plan table and the CPU config that can run.
if [[ -z "${MOETRAIN_DEVICE:-}" && -z "${MOETRAIN_ENTRY:-}" ]]; then
  python - "$CONFIG" ${SETS[@]+"${SETS[@]}"} <<'PY' || exit 3
import sys
from moetrain.planner.cli import explain_cannot_run_here, load_plan_config
overrides = [a for a in sys.argv[2:] if a != "--set"]
try:
    message = explain_cannot_run_here(load_plan_config(sys.argv[1], overrides))
except ValueError as exc:    # ConfigError, LayoutError: said before any worker starts
    message = f"config error: {exc}"
if message:
    print(message, file=sys.stderr)
    sys.exit(1)
PY
fi
OUT="${MOETRAIN_OUTPUT_DIR:-}"
DEVICE="${MOETRAIN_DEVICE:-}"
if [[ -z "$OUT" ]]; then OUT="$(config_value train.output_dir runs)"; fi
if [[ -z "$DEVICE" ]]; then DEVICE="$(config_value train.device cpu)"; fi

read -r -a ENTRY <<< "${MOETRAIN_ENTRY:-python -m moetrain.cli train}"
if [[ "${MOETRAIN_COMPILE_CACHE:-0}" == "1" ]]; then
  export MS_COMPILER_CACHE_ENABLE=1
  export MS_COMPILER_CACHE_PATH="$OUT/compile_cache"
fi

LAUNCH=(python -m moetrain.distributed.launch --nproc "$NPROC" --nnodes "$NNODES" --node-rank "$NODE_RANK"
        --master-addr "$MASTER_ADDR" --log-dir "$OUT/logs")
if [[ -n "$PORT" ]]; then LAUNCH+=(--master-port "$PORT"); fi
if [[ -n "${MOETRAIN_TIMEOUT:-}" ]]; then LAUNCH+=(--timeout "$MOETRAIN_TIMEOUT"); fi
LAUNCH+=(${FAULT_ARGS[@]+"${FAULT_ARGS[@]}"})
# Core binding pays off with one accelerator per process; CPU workers share the cores.
if [[ "$DEVICE" != "cpu" ]]; then LAUNCH+=(--bind-core); fi

echo "run_distributed.sh: $((NPROC * NNODES)) ranks ($NPROC on node $NODE_RANK of $NNODES), device $DEVICE, logs in $OUT/logs" >&2
exec "${LAUNCH[@]}" -- "${ENTRY[@]}" "$CONFIG" ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"}
