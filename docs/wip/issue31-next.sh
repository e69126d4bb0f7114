#!/usr/bin/env bash
# Issue 31, the next lease (carry .deps; one nvidia-h200 or H100):
#   bash docs/wip/issue31-next.sh ab    (~510 s cold) applies docs/wip/issue31-warp-tiles.patch, builds into /tmp/bl
#       (tests and bench), runs the LoRA layer tests, then the bf16 LoRA r16 grid (4 adapters, share 1.0,
#       M = 256, 1024, 4096, every model) with the warp tiles (checked against float64), with
#       MOELORA_LORA_SHRINK_WARP_TILES=0, with MOELORA_LORA_EXPAND_WARP_TILES=0, with both off (main's kernels) and
#       with both =2 (the warp tiles at every run length),
#       and Qwen3-30B's and DeepSeek-V3's LoRA kernels one by one (tools/profile_layer.sh) at M = 256 / 1024 with
#       the warp tiles. Prints the A/B last.
#   bash docs/wip/issue31-next.sh diag MODEL M [M...]   (~30 s warm) Nsight Compute's sections (speed of light,
#       launch, occupancy, warp states, memory, source counters) for the first launch of each LoRA kernel
#       (moe_lora_*) of MODEL's LoRA r16 layer at each M; $OUT/ncu_<M>.txt and a digest.
# If the warp tiles win (either knob's half alone may): land what wins (git apply, drop the losing half), then
# docs/wip/lease-proof.sh tests and grids.
# The patch, where the mean (expert, adapter) run num_slots / (E * max_loras) is under 32 entries:
#  - moe_lora_shrink_warp_tiles_kernel: a CTA an mma.m16n8k16 tile of 16 entries x one adapter x up to 32 lora_a
#    rows, its four warps a quarter of K each (summed in shared memory), operands from global memory straight into
#    fragments. A first version (a warp over all of K) measured once (forty-third session; 21 LoRA tests pass,
#    rel_err unchanged): Qwen3-30B LoRA M = 256 521 -> 498 us, M = 1024 647 -> 617; OLMoE M = 256 392 -> 381;
#    DeepSeek-V3 (K 7168) M = 256 1146 -> 1133, M = 1024 1430 -> 1512 (long warps in 1.5 waves: hence K quarters,
#    not yet measured).
#  - moe_lora_expand_{entries,activation}_warp_tiles_kernel (rank % 8 == 0, 16-byte rows): a warp a 16-entry tile x
#    64 stack columns (the join: 32 outputs' gate and up), every adapter of the tile on mma fragments loaded the
#    same way, the sums added into the output rows (or through the activation) in registers. Not yet run: the
#    tests in the patch take it at M = 160-300 (rank 16-128, interleaved, one slice, fp16, swiglu_oai).
set -uo pipefail
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
B=/tmp/bl
build() {
  MOELORA_JOBS=16 MOELORA_BUILD_DIR=$B MOELORA_PTH=0 bash tools/build.sh -DMOELORA_CUDA=ON -DMOELORA_BUILD_PYTHON=OFF \
    > /tmp/build.log 2>&1 || { grep -B2 -A12 "error" /tmp/build.log | head -60; exit 1; }
  echo "build $(el) s"
}
case "${1:-}" in
ab)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  git apply docs/wip/issue31-warp-tiles.patch || { echo "patch failed"; exit 1; }
  build
  timeout 90 $B/moelora_tests --gtest_filter='All/FusedExpertsLoraTest.*:All/LoraDeltaTest.*:Configs/FusedExpertsLoraCudaGraph.*:FusedExpertsLoraWarpTilesOff.*' > $OUT/tests.log 2>&1
  echo "LoRA tests rc $? at $(el) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]" $OUT/tests.log | head -20
  timeout 150 $B/moelora_bench --device cuda --model all --tokens 256,1024,4096 --lora-rank 16 --adapters 4 \
    --lora-share 1.0 --json /tmp/tiles.json > /tmp/tiles.log 2>&1; echo "warp tiles grid rc $? at $(el) s"
  tail -1 /tmp/tiles.log
  for v in shrink_off:MOELORA_LORA_SHRINK_WARP_TILES expand_off:MOELORA_LORA_EXPAND_WARP_TILES; do
    env ${v#*:}=0 timeout 60 $B/moelora_bench --device cuda --model all --tokens 256,1024,4096 --lora-rank 16 \
      --adapters 4 --lora-share 1.0 --no-check --json /tmp/${v%%:*}.json > /tmp/${v%%:*}.log 2>&1
    echo "${v%%:*} grid rc $? at $(el) s"
  done
  MOELORA_LORA_SHRINK_WARP_TILES=0 MOELORA_LORA_EXPAND_WARP_TILES=0 timeout 60 $B/moelora_bench --device cuda \
    --model all --tokens 256,1024,4096 --lora-rank 16 --adapters 4 --lora-share 1.0 --no-check --json /tmp/main.json \
    > /tmp/main.log 2>&1; echo "both off (main's kernels) grid rc $? at $(el) s"
  # The warp tiles at every run length (2): whether the run-length switch (32 entries) is where it pays.
  MOELORA_LORA_SHRINK_WARP_TILES=2 MOELORA_LORA_EXPAND_WARP_TILES=2 timeout 60 $B/moelora_bench --device cuda \
    --model all --tokens 256,1024,4096 --lora-rank 16 --adapters 4 --lora-share 1.0 --no-check --json /tmp/always.json \
    > /tmp/always.log 2>&1; echo "warp tiles always grid rc $? at $(el) s"
  for cell in "qwen3-30b-a3b 256" "deepseek-v3-tp8 1024"; do
    set -- $cell
    timeout 50 bash tools/profile_layer.sh $B moelora_bench --model $1 --tokens $2 --lora-rank 16 --adapters 4 \
      > /tmp/kernels_$1_$2.txt 2>&1; echo "kernels $1 M=$2 rc $? at $(el) s"
  done
  cp /tmp/tiles.json /tmp/shrink_off.json /tmp/expand_off.json /tmp/main.json /tmp/always.json $OUT/
  python3 - <<'PY' | tee $OUT/ab.txt
import json
def load(n):
    try: return {(r["model"], r["M"], bool(r.get("lora"))): r for r in json.load(open(n))["rows"]}
    except Exception as e: print("missing", n, e); return {}
m, s, e, b, a = (load(f"/tmp/{n}.json") for n in ("main", "shrink_off", "expand_off", "tiles", "always"))
print("## bf16 LoRA r16, 4 adapters (CUDA-graph medians, us): both off (main's kernels) / expand warp tiles only")
print("## (shrink off) / shrink warp tiles only (expand off) / both (where runs are short) / both at every run")
print("## length (=2); each / main; % of floor, rel_err of 'both'")
for k in sorted(b):
    if k in m:
        x = m[k]["time_us"]
        y = [d.get(k, {}).get("time_us", float("nan")) for d in (s, e, b, a)]
        print(f"{k[0]:18s} M={k[1]:<5d} {'lora' if k[2] else 'base'} {x:8.1f} " + " ".join(f"{v:8.1f}" for v in y) +
              " " + " ".join(f"{v / x:6.3f}" for v in y) + f" {b[k]['pct_floor']:5.1f} {b[k].get('rel_err')}")
PY
  for f in /tmp/kernels_*.txt; do echo "## $f (tools/profile_layer.sh)"; cat $f; done | tee -a $OUT/ab.txt
  ;;
diag)
  model=${2:?model}; shift 2
  [ -x $B/moelora_bench ] || build
  sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
    --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters"
  for M in "$@"; do
    # The first layer call's LoRA kernels in launch order.
    timeout 150 ncu --clock-control none --graph-profiling node -k regex:moe_lora_ --launch-count 4 $sections \
      $B/moelora_bench --device cuda --iters 3 --no-check --model $model --tokens $M --lora-rank 16 \
      --adapters 4 > $OUT/ncu_$M.txt 2>&1
    echo "ncu M=$M rc $? at $(el) s"
    echo "## $model M=$M"
    grep -E "^  void|Duration|DRAM Throughput|Elapsed Cycles|SM Active Cycles|Achieved Occupancy|Registers Per|Grid Size|Issued Warp Per|excessive" \
      $OUT/ncu_$M.txt | sed 's/(LoraDeltaParams.*//' | cut -c1-150
  done | tee $OUT/diag.txt
  ;;
*) echo "usage: bash docs/wip/issue31-next.sh ab | diag MODEL M [M...]"; exit 2 ;;
esac
echo "done $(el) s"
