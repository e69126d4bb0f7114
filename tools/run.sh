#!/usr/bin/env bash
# The main job: installs dependencies, builds, and runs the MoE layer at a real model's
# shapes on the GPU when present, else the CPU; checks it against a float64 reference
# and prints time, bandwidth and FLOP rate. With no arguments: Qwen3-30B-A3B at 16 tokens,
# with and without 4 LoRA adapters of rank 16 (the LoRA tax). Arguments go to
# moelora_bench instead, e.g.
#   bash tools/run.sh --model mixtral-8x7b --tokens 1,16,256 --lora-rank 16,64
set -euo pipefail
cd "$(dirname "$0")/.."
# The benchmark needs no torch: skip its multi-GB install here (tools/test.sh does it).
[ "${MOELORA_SKIP_INSTALL:-0}" = 1 ] || MOELORA_TORCH=${MOELORA_TORCH:-0} bash tools/install_deps.sh >/dev/null
bash tools/build.sh >/dev/null
[ $# -gt 0 ] || set -- --lora-rank 16
exec "${MOELORA_BUILD_DIR:-build}/moelora_bench" "$@"
