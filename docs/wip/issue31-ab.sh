#!/usr/bin/env bash
# Run on the device from the repository root (one H200 or H100, ~570 s): two issue-31 wip patches, A/B in one lease.
#  docs/wip/issue31-sm80-early-weights.patch: the sm80 tile kernel (the cells the tables give 16/32/64-row sm80 tiles:
#  M <= 256 on the 64-256-expert models, and the fused LoRA path) asks for its first stages' weights before reading its slot
#  table, reads the count and the expert in one round trip, and reads GEMM2's routed weights after its first loads. ncu (H200,
#  0dd045e, Qwen3-30B M = 16): GEMM1 128 us, GEMM2 71 us against the searched Triton peer's 118.8 / 62.5. Prediction: layer
#  M = 16-256 on Qwen3-30B / OLMoE / DeepSeek-V3-TP8 3-6% faster (GEMM2 at M = 16-64 5-10%); M = 1-4 and sm90 cells unchanged.
#  docs/wip/issue31-late-waits.patch (after it): the LoRA expand GEMV lets the next kernel launch at entry (the decode GEMMs
#  stream beside the shrink too); the fused path's shrinks trigger right after their wait and the sm80 tiles wait only before
#  their first LoRA K step; MOELORA_LATE_WAITS=0 turns every GEMM late wait off (today's small-batch one included).
#  Predictions: late waits on vs off, LoRA r16 M = 1 Qwen3-30B ~-6 us (two landed ~2 us + the expand's ~3 us), M = 16-256 on the
#  small-expert models 10-20 us faster; bases unchanged.
# Columns: before = HEAD; off = patched, MOELORA_LATE_WAITS=0; on = patched (default). Early weights: off vs before at M >= 16.
set -uo pipefail
B=/tmp/b; t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
build() { MOELORA_JOBS=16 MOELORA_BUILD_DIR=$B MOELORA_PTH=0 bash tools/build.sh -DMOELORA_CUDA=ON > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }; }
build; echo "build $(el) s"
mkdir -p /tmp/ab
run() {  # label [env]
  env ${2:-X=0} timeout 75 $B/moelora_bench --device cuda --model all --tokens 1,4,16,64,256 --lora-rank 16 --adapters 4 --lora-share 1.0 \
    --no-check --json /tmp/ab/$1.json >> /tmp/bench.log 2>&1
  echo "$1 rc $? at $(el) s"
}
run before
git apply docs/wip/issue31-sm80-early-weights.patch && git apply docs/wip/issue31-late-waits.patch || { echo "patch failed"; exit 1; }
build; echo "rebuild $(el) s"
run off MOELORA_LATE_WAITS=0
run on
python3 - <<'PY' | tee $OUT/ab.txt
import json
def load(n):
    try: return {(r["model"], r["M"], bool(r.get("lora"))): r["time_us"] for r in json.load(open(f"/tmp/ab/{n}.json"))["rows"]}
    except Exception as e: print("missing", n, e); return {}
x, y, z = load("before"), load("off"), load("on")
print("## before (HEAD) / off (patched, MOELORA_LATE_WAITS=0) / on (patched), us; LoRA r16, 4 adapters, share 1.0;")
print("## then off/before (the early weights at M >= 16) and on/off (the late waits)")
for k in sorted(x):
    if k in y: print(f"{k[0]:18s} M={k[1]:<5d} {'lora' if k[2] else 'base'} {x[k]:9.1f} {y[k]:9.1f} {z.get(k, float('nan')):9.1f} {y[k] / x[k]:6.3f} {z.get(k, float('nan')) / y[k]:6.3f}")
PY
# A first check only: a winner lands with the project's proof (the whole C++ suite, pytest on the GPU, memcheck,
# the grids; tools/gpu_report.sh or its parts).
left=$(( 570 - $(el) ))
[ $left -gt 30 ] && GTEST_FILTER='Shapes/FusedMoeTest.*:All/FusedExpertsLoraTest.*:*lora16_small_batch:*CUDA_w4a16_lora_decode*' \
  timeout $left python3 tools/gtest_shards.py --binary $B/moelora_tests --shards 14 --gpus 1 --timeout $(( left - 5 )) \
  --junit /tmp/g.xml > $OUT/gtest.log 2>&1
echo "patched gtests (a first check) rc $? at $(el) s"; tail -2 $OUT/gtest.log
