#!/usr/bin/env bash
# Where one layer cell's time goes, kernel by kernel (Nsight Compute, clocks not locked,
# each CUDA-graph node profiled): on the GPU machine, after tools/build.sh.
#   tools/profile_layer.sh BUILD_DIR BENCH [ARGS...]
#   e.g. tools/profile_layer.sh /tmp/bg quant_bench --model qwen3-30b-a3b --tokens 4096 --scheme fp8_block
# Runs BENCH (moelora_bench or quant_bench) for its cells with 3 graph replays and no check,
# and prints each kernel of one layer call in launch order with its median duration over
# the profiled calls and its share of their sum (tools/ncu_summary.py). Profile one cell at
# a time: the summary cuts the launches into layer calls at each repeat of the first kernel.
# NOTE: ncu serialises the kernels and replays each: durations are each kernel alone, with
# no launch gaps and no overlap between kernels (the graph's time is the bench's number).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 BUILD_DIR BENCH [ARGS...]" >&2; exit 2; }
BUILD_DIR=$1
BENCH=$2
shift 2
CSV=$(mktemp)
ERR=$(mktemp)
if ! ncu --clock-control none --graph-profiling node --metrics gpu__time_duration.sum --csv --page raw \
    "$BUILD_DIR/$BENCH" --device cuda --iters 3 --no-check "$@" >"$CSV" 2>"$ERR"; then
  tail -20 "$ERR" >&2
  exit 1
fi
python3 tools/ncu_summary.py "$CSV"
