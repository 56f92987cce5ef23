#!/usr/bin/env bash
# Eight ranks on this node: run_scripts/run_8p.sh CONFIG [--set key=value ...] [--resume [DIR]]
exec "$(dirname "$0")/run_distributed.sh" --nproc 8 "$@"
