#!/usr/bin/env bash
# One node's share of a multi-node job; run the same command on every node with its --node-rank.
#
#   run_scripts/run_multinode.sh --nnodes K --node-rank R --nproc-per-node N \
#       --master-addr A --master-port P [--max-restarts M] CONFIG [--set key=value ...] [--resume [DIR]]
#
# Node rank 0 hosts the scheduler at A:P (A must be one of its addresses); ranks R*N .. R*N+N-1
# run here. Each node's watchdog stops its own ranks when one fails; ranks elsewhere fail within
# the collective timeout (--collective-timeout, default 300 s) and their nodes stop too.
# train.output_dir must be on a filesystem every node shares (checked at start, docs/checkpoints.md).
# --max-restarts M (same on every node): each node relaunches its ranks after a failure; relaunch k
# uses port P+k, so P..P+M must be free on node 0. Environment as in run_distributed.sh.
set -euo pipefail

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }

NNODES="" NODE_RANK="" NPROC="" ADDR="" PORT="" FAULT_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nnodes) NNODES="$2"; shift 2 ;;
    --node-rank) NODE_RANK="$2"; shift 2 ;;
    --nproc-per-node) NPROC="$2"; shift 2 ;;
    --master-addr) ADDR="$2"; shift 2 ;;
    --master-port) PORT="$2"; shift 2 ;;
    --max-restarts|--hang-timeout|--collective-timeout|--preempt-grace) FAULT_ARGS+=("$1" "$2"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    --*) echo "run_multinode.sh: unknown option $1 (launcher options go before CONFIG)" >&2; usage >&2; exit 2 ;;
    *) break ;;
  esac
done
for var in NNODES NODE_RANK NPROC ADDR PORT; do
  if [[ -z "${!var}" ]]; then
    echo "run_multinode.sh: missing --nnodes, --node-rank, --nproc-per-node, --master-addr or --master-port" >&2
    usage >&2; exit 2
  fi
done
exec "$(dirname "$0")/run_distributed.sh" --nproc "$NPROC" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$ADDR" --master-port "$PORT" ${FAULT_ARGS[@]+"${FAULT_ARGS[@]}"} "$@"
