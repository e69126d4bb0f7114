#!/usr/bin/env bash
# Issue 31, the next lease (carry .deps; one nvidia-h200 or H100):
#   bash docs/wip/issue31-next.sh ab    (~480 s cold) applies docs/wip/issue31-narrow-expands.patch (the expand-activation
#       join in tiles of 32 outputs, 4 CTAs an SM, instead of 64 outputs at 2; GEMM2's expand in 32 columns at 6 CTAs
#       an SM behind a knob), builds into /tmp/bl (tests and bench), runs the LoRA layer tests, then the bf16 LoRA r16
#       grid (4 adapters, share 1.0, M = 256, 1024, 4096, every model): the patch's default (checked against
#       float64); MOELORA_LORA_JOIN_OUTPUTS=64 (main's join); MOELORA_LORA_EXPAND_COLUMNS=32 (with the join in 32);
#       MOELORA_LORA_EXPAND_ACTIVATION=0 (no join: GEMM1's expand into its rows, then the activation kernel, as the
#       peer does); MOELORA_LORA_SHRINK_WARP_TILES=2 (the warp-tile shrink at every run length, alone: the
#       forty-fourth session's "=2" run had the warp-tile expands with it); and the LoRA kernels one by one (Qwen3-30B
#       at M = 4096, 1024 and 256, DeepSeek-V3 at 1024) with the patch. Prints the A/B last.
#   (The first 'ab', of docs/wip/issue31-warp-tiles.patch, ran in the forty-fourth session: the shrink half landed in
#   b56ac77, the expand half lost; docs/perf_notes/issues-31-33.md.)
#   bash docs/wip/issue31-next.sh diag MODEL M [M...]   (~30 s warm) Nsight Compute's sections (speed of light,
#       launch, occupancy, warp states, memory, source counters) for the first launch of each LoRA kernel
#       (moe_lora_*) of MODEL's LoRA r16 layer at each M; $OUT/ncu_<M>.txt and a digest.
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
  git apply docs/wip/issue31-narrow-expands.patch || { echo "patch failed"; exit 1; }
  build
  timeout 90 $B/moelora_tests --gtest_filter='All/FusedExpertsLoraTest.*:All/LoraDeltaTest.*:Configs/FusedExpertsLoraCudaGraph.*:FusedExpertsLoraWarpTilesOff.*:FusedExpertsLoraTileWidths.*' > $OUT/tests.log 2>&1
  echo "LoRA tests rc $? at $(el) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]" $OUT/tests.log | head -20
  grid="--device cuda --model all --tokens 256,1024,4096 --lora-rank 16 --adapters 4 --lora-share 1.0"
  timeout 150 $B/moelora_bench $grid --json /tmp/narrow.json > /tmp/narrow.log 2>&1; echo "join 32 grid rc $? at $(el) s"
  tail -1 /tmp/narrow.log
  for v in wide:MOELORA_LORA_JOIN_OUTPUTS=64 expand32:MOELORA_LORA_EXPAND_COLUMNS=32 \
           unfused:MOELORA_LORA_EXPAND_ACTIVATION=0 shrink_tiles:MOELORA_LORA_SHRINK_WARP_TILES=2; do
    env ${v#*:} timeout 60 $B/moelora_bench $grid --no-check --json /tmp/${v%%:*}.json > /tmp/${v%%:*}.log 2>&1
    echo "${v%%:*} grid rc $? at $(el) s"
  done
  # Qwen3-30B at M = 4096 and 256, and DeepSeek-V3 at 1024 (LoRA 1.31x of the peer at b56ac77; no kernel profile of
  # main's kernels there yet).
  for cell in "qwen3-30b-a3b 4096" "qwen3-30b-a3b 1024" "qwen3-30b-a3b 256" "deepseek-v3-tp8 1024"; do
    set -- $cell
    timeout 50 bash tools/profile_layer.sh $B moelora_bench --model $1 --tokens $2 --lora-rank 16 --adapters 4 \
      > /tmp/kernels_$1_$2.txt 2>&1; echo "kernels $1 M=$2 rc $? at $(el) s"
  done
  # ncu's sections for the patched expands at Qwen3-30B M = 4096 (the join and GEMM2's expand of one layer call).
  timeout 60 ncu --clock-control none --graph-profiling node -k regex:moe_lora_expand --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    $B/moelora_bench --device cuda --iters 3 --no-check --model qwen3-30b-a3b --tokens 4096 --lora-rank 16 \
    --adapters 4 > $OUT/ncu_expands_4096.txt 2>&1; echo "ncu expands rc $? at $(el) s"
  # $OUT takes at most 8 files: the grids in one archive.
  tar czf $OUT/grids.tgz -C /tmp narrow.json wide.json expand32.json unfused.json shrink_tiles.json
  python3 - <<'PY' | tee $OUT/ab.txt
import json
def load(n):
    try: return {(r["model"], r["M"], bool(r.get("lora"))): r for r in json.load(open(n))["rows"]}
    except Exception as e: print("missing", n, e); return {}
w, n, e, u, s = (load(f"/tmp/{x}.json") for x in ("wide", "narrow", "expand32", "unfused", "shrink_tiles"))
print("## bf16 LoRA r16, 4 adapters (CUDA-graph medians, us): main's expands (join in 64 outputs, GEMM2's expand in")
print("## 64 columns) / the join in 32 / and GEMM2's expand in 32 / no join (GEMM1's expand, then the activation")
print("## kernel) / the join in 32 with the warp-tile shrink at every run length; each / main's; % of floor and")
print("## rel_err of the join in 32")
for k in sorted(n):
    if k in w:
        x = w[k]["time_us"]
        y = [d.get(k, {}).get("time_us", float("nan")) for d in (n, e, u, s)]
        print(f"{k[0]:18s} M={k[1]:<5d} {'lora' if k[2] else 'base'} {x:8.1f} " + " ".join(f"{v:8.1f}" for v in y) +
              " " + " ".join(f"{v / x:6.3f}" for v in y) + f" {n[k]['pct_floor']:5.1f} {n[k].get('rel_err')}")
PY
  for f in /tmp/kernels_*.txt; do echo "## $f (tools/profile_layer.sh)"; cat $f; done | tee -a $OUT/ab.txt
  grep -E "^  void|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Issued Warp Per|excessive" \
    $OUT/ncu_expands_4096.txt | sed 's/(LoraDeltaParams.*//' | cut -c1-150 | tee -a $OUT/ab.txt
  ;;
stream)
  # The expands streaming a stride of column tiles at every run length (MOELORA_LORA_EXPAND_STREAM=2) against the
  # rule (mean run >= 32): DeepSeek-V3 M = 1024's GEMM2 expand took 300 us over 48,048 one-tile CTAs at dfb4c78.
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  build
  grid="--device cuda --model all --tokens 256,1024,4096 --lora-rank 16 --adapters 4 --lora-share 1.0"
  timeout 100 $B/moelora_bench $grid --json /tmp/rule.json > /tmp/rule.log 2>&1; echo "rule grid rc $? at $(el) s"
  MOELORA_LORA_EXPAND_STREAM=2 timeout 100 $B/moelora_bench $grid --json /tmp/always.json > /tmp/always.log 2>&1
  echo "always grid rc $? at $(el) s"; tail -1 /tmp/always.log
  for cell in "deepseek-v3-tp8 1024" "qwen3-30b-a3b 256"; do
    set -- $cell
    MOELORA_LORA_EXPAND_STREAM=2 timeout 50 bash tools/profile_layer.sh $B moelora_bench --model $1 --tokens $2 \
      --lora-rank 16 --adapters 4 > /tmp/kernels_$1_$2.txt 2>&1; echo "kernels $1 M=$2 rc $? at $(el) s"
  done
  tar czf $OUT/grids.tgz -C /tmp rule.json always.json
  python3 - <<'PY' | tee $OUT/stream.txt
import json
def load(n):
    try: return {(r["model"], r["M"], bool(r.get("lora"))): r for r in json.load(open(n))["rows"]}
    except Exception as e: print("missing", n, e); return {}
a, b = load("/tmp/rule.json"), load("/tmp/always.json")
print("## bf16 LoRA r16, 4 adapters (us): streaming by the rule / at every run length; ratio; rel_err of the second")
for k in sorted(a):
    if k in b and k[2]:
        print(f"{k[0]:18s} M={k[1]:<5d} {a[k]['time_us']:8.1f} {b[k]['time_us']:8.1f} "
              f"{b[k]['time_us'] / a[k]['time_us']:6.3f} {b[k].get('rel_err')}")
PY
  for f in /tmp/kernels_*.txt; do echo "## $f (MOELORA_LORA_EXPAND_STREAM=2)"; cat $f; done | tee -a $OUT/stream.txt
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
*) echo "usage: bash docs/wip/issue31-next.sh ab | stream | diag MODEL M [M...]"; exit 2 ;;
esac
echo "done $(el) s"
