#!/usr/bin/env bash
# On a machine with 2 or more GPUs (issue 32): builds the Python extension with the CUDA
# backend, runs the distributed tests over gloo and then over NCCL (EP, TP, EP x TP with 4
# GPUs, LoRA, quantized experts, each rank on its GPU), then benchmarks/distributed_bench.py
# under torchrun over NCCL for Qwen3-235B-A22B and DeepSeek-V3 (all 256 experts) at M = 16,
# 256, 4096: EP over all GPUs with each dispatch, and TP over all GPUs; each run checks the ranks' output against the
# one-GPU layer, and --breakdown says where the time goes (each rank's experts alone, the
# bare collective, CUDA-graph replays). Rows: ${OUT:-reports/gpu}/distributed.json (op "fused_experts_ep").
#   NPROC     ranks (default: the GPUs nvidia-smi lists)
#   MODELS    default "qwen3-235b-a22b deepseek-v3"; TOKENS default 16,256,4096
#   DISPATCH  default "all_reduce all_to_all all_gather tp" (tp: --tp NPROC --ep 1, all-reduce combine)
#   SKIP_BUILD=1  take the extension already built in MOELORA_BUILD_DIR (e.g. by tools/build.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-reports/gpu}
mkdir -p "$OUT_DIR"
BUILD_DIR=${MOELORA_BUILD_DIR:-build-gpu}
N=${NPROC:-$(nvidia-smi -L | wc -l)}
LOG="$OUT_DIR/distributed.log"
: > "$LOG"
step() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  step "build (the extension, $N GPUs)"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOELORA_CUDA=ON -DMOELORA_BUILD_PYTHON=ON \
    -DMOELORA_BUILD_TESTS=OFF -DMOELORA_BUILD_BENCHMARKS=OFF -DPython_EXECUTABLE="$(command -v python3)" >>"$LOG" 2>&1 &&
    cmake --build "$BUILD_DIR" -j "$(nproc)" >>"$LOG" 2>&1 || { tail -40 "$LOG"; exit 1; }
fi
export MOELORA_EXT_DIR="$PWD/$BUILD_DIR" PYTHONPATH="$PWD/python"

step "pytest tests/python/test_distributed.py (gloo)"
python3 -m pytest tests/python/test_distributed.py -q --junitxml="$OUT_DIR/pytest_distributed.xml" 2>&1 | tail -3 | tee -a "$LOG"
step "pytest tests/python/test_distributed.py (NCCL, one GPU a rank)"
MOELORA_DIST_BACKEND=nccl python3 -m pytest tests/python/test_distributed.py -k processes -q -rs \
  --junitxml="$OUT_DIR/pytest_distributed_nccl.xml" 2>&1 | tail -4 | tee -a "$LOG"

status=0
JSONS=()
for model in ${MODELS:-qwen3-235b-a22b deepseek-v3}; do
  for dispatch in ${DISPATCH:-all_reduce all_to_all all_gather tp}; do
    step "torchrun $N x $model $dispatch"
    json="$OUT_DIR/distributed_${model}_${dispatch}.json"
    if [ "$dispatch" = tp ]; then grid=(--tp "$N" --ep 1 --dispatch all_reduce); else grid=(--ep "$N" --dispatch "$dispatch"); fi
    python3 -m torch.distributed.run --nproc-per-node "$N" benchmarks/distributed_bench.py --model "$model" \
      --tokens "${TOKENS:-16,256,4096}" "${grid[@]}" --breakdown --json "$json" 2>&1 |
      grep -E "op=|verdict|Error|error" | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    [ -f "$json" ] && JSONS+=("$json")
  done
done
python3 - "$OUT_DIR/distributed.json" "${JSONS[@]}" <<'PY'
import json, sys
rows = [row for path in sys.argv[2:] for row in json.load(open(path))]
json.dump(rows, open(sys.argv[1], "w"), indent=1)
print(f"{len(rows)} rows -> {sys.argv[1]}")
PY
rm -f "${JSONS[@]}"
exit $status
