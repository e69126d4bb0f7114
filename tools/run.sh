#!/usr/bin/env bash
# The main job: installs dependencies, builds, and runs the MoE layer at a real model's
# shapes on the GPU when present, else the CPU; checks it against a float64 reference
# and prints time, bandwidth and FLOP rate, and a verdict. With no arguments: Qwen3-30B-A3B
# at 16 tokens, with and without 4 LoRA adapters of rank 16 (the LoRA tax). Arguments go
# to moelora_bench instead, e.g.
#   bash tools/run.sh --model mixtral-8x7b --tokens 1,16,256 --lora-rank 16,64
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${MOELORA_BUILD_DIR:-build}
step() { printf '== %s\n' "$*"; }

if [ "${MOELORA_SKIP_INSTALL:-0}" != 1 ]; then
  step "[1/3] dependencies (pinned, from the package registries; the benchmark needs no torch, so it is skipped here)"
  MOELORA_TORCH=${MOELORA_TORCH:-0} bash tools/install_deps.sh
fi

if command -v nvcc >/dev/null 2>&1 && [ "${MOELORA_CUDA:-AUTO}" != OFF ]; then
  what="the CPU and CUDA backends (nvcc found; MOELORA_CUDA=OFF builds the CPU backend only)"
else
  what="the CPU backend (no nvcc)"
fi
step "[2/3] building $what into $BUILD_DIR/; a first build takes minutes (about 8 on 2 cores without CUDA)"
mkdir -p "$BUILD_DIR"
LOG="$BUILD_DIR/run_build.log"
# Progress: ninja's [done/total] lines, one in each tenth of the way; everything to $LOG.
if ! bash tools/build.sh 2>&1 | tee "$LOG" | awk '
    /^\[[0-9]+\/[0-9]+\]/ { step = $1; gsub(/[][]/, "", step); split(step, n, "/"); tenth = int(10 * n[1] / n[2]);
                            if (tenth > shown) { shown = tenth; printf "   built %s of %s steps\n", n[1], n[2]; fflush() } }
    /^python: / { print "   " $0; fflush() }
    /^-- Configuring done|^-- Build files have been written/ { print "   " $0; fflush() }'; then
  echo "error: the build failed. The compiler's messages (all of it: $LOG, $BUILD_DIR/build.log):" >&2
  grep -E -B2 -A8 "error|Error|ERROR" "$LOG" | head -80 >&2 || tail -40 "$LOG" >&2
  exit 1
fi

[ $# -gt 0 ] || set -- --lora-rank 16
step "[3/3] moelora_bench $*"
exec "$BUILD_DIR/moelora_bench" "$@"
