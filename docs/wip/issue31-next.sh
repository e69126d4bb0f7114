#!/usr/bin/env bash
# Issue 31, the next lease (carry .deps; one nvidia-h200 or H100):
#   bash docs/wip/issue31-next.sh ab   (~420 s cold) applies docs/wip/issue31-groups-occupancy.patch (the groups
#       kernel at 8, 10 or 12 CTAs an SM: MOELORA_LORA_EXPAND_GROUPS_CTAS) and issue31-gather-prefetch.patch (the
#       gather's next slot id in flight, one wave of resident CTAs: its kernel time at Qwen3-30B M = 1024 and 4096
#       against e89f6fd's 13.2 and 52.3 us), builds into /tmp/bl, runs the LoRA layer
#       tests, the unchecked LoRA r16 grid at M = 256 and 1024 (where the rule takes the groups) at 8, 10 and 12, the
#       kernels at Qwen3-30B M = 1024 and DeepSeek-V3 M = 256 at 8 and 12 and DeepSeek-V3 M = 1024 (groups=2) at 10, 12, then ncu's source page of the groups
#       kernel (GEMM2's) at DeepSeek-V3 M = 256 at 8 ($OUT/source_256.csv). Prints the A/B.
#   (Its earlier 'ab's: docs/wip/issue31-warp-tiles.patch in the forty-fourth session, issue31-narrow-expands.patch in the
#   forty-fifth (landed as dfb4c78), the expand schedule, groups and shared-vectors patches in the forty-sixth (landed
#   as e89f6fd); docs/perf_notes/issues-31-33.md. For a same-run A/B of landed knobs: PROOF_AB in lease-proof.sh.)
#   bash docs/wip/issue31-next.sh diag MODEL M [M...]   (~30 s warm) Nsight Compute's sections (speed of light,
#       launch, occupancy, warp states, memory, source counters) for the first launch of each LoRA kernel
#       (moe_lora_*) of MODEL's LoRA r16 layer at each M; $OUT/ncu_<M>.txt and a digest.
#   bash docs/wip/issue31-next.sh source MODEL M REGEX [SKIP]   (~60 s warm, ~240 s cold; not yet run) ncu's source page (SASS) of the first
#       kernel matching REGEX: the top instructions by stall samples, excess global sectors and shared wavefronts.
#   bash docs/wip/issue31-next.sh peer MODEL M   (~90 s; not yet run) ncu's sections for the peer's LoRA kernels
#       (its Triton shrink and expand, this GPU's searched configs): what its expand does that ours does not.
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
  git apply docs/wip/issue31-groups-occupancy.patch && git apply docs/wip/issue31-gather-prefetch.patch ||
    { echo "patches failed"; exit 1; }
  build
  tests='All/FusedExpertsLoraTest.*:Configs/FusedExpertsLoraCudaGraph.*:FusedExpertsLoraExpandSchedules.*:FusedExpertsLoraExpandGroups.*'
  timeout 90 $B/moelora_tests --gtest_filter="$tests" > $OUT/tests.log 2>&1
  echo "LoRA tests rc $? at $(el) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]" $OUT/tests.log | head -20
  grid="--device cuda --model all --tokens 256,1024 --lora-rank 16 --adapters 4 --lora-share 1.0 --no-check"
  for c in 8 10 12; do
    MOELORA_LORA_EXPAND_GROUPS_CTAS=$c timeout 45 $B/moelora_bench $grid --json /tmp/ctas$c.json > /tmp/ctas$c.log 2>&1
    echo "ctas $c grid rc $? at $(el) s"
  done
  # And DeepSeek-V3 M = 1024 with the groups everywhere (=2; the rule streams the tiles there): GEMM2's expand by
  # groups against the peer's 127.9 us under ncu (e89f6fd's lease) and ours at 8 CTAs, 259.
  for cell in "8 qwen3-30b-a3b 1024 1" "12 qwen3-30b-a3b 1024 1" "8 deepseek-v3-tp8 256 1" "12 deepseek-v3-tp8 256 1" \
              "10 deepseek-v3-tp8 1024 2" "12 deepseek-v3-tp8 1024 2" "8 qwen3-30b-a3b 4096 1"; do
    set -- $cell
    MOELORA_LORA_EXPAND_GROUPS_CTAS=$1 MOELORA_LORA_EXPAND_GROUPS=$4 timeout 30 bash tools/profile_layer.sh $B \
      moelora_bench --model $2 --tokens $3 --lora-rank 16 --adapters 4 > /tmp/kernels_$1_$2_$3.txt 2>&1
    echo "kernels $1 $2 M=$3 groups=$4 rc $? at $(el) s"
  done
  python3 - <<'PY' | tee $OUT/ab.txt
import json
load = lambda n: {(r["model"], r["M"]): r["time_us"] for r in json.load(open(f"/tmp/{n}.json"))["rows"] if r.get("lora")}
a, b, c = load("ctas8"), load("ctas10"), load("ctas12")
print("## bf16 LoRA r16, 4 adapters (unchecked CUDA-graph medians, us): the groups kernel at 8 / 10 / 12 CTAs an SM;")
print("## 10 / 8, 12 / 8. The rule takes the groups at M = 256 everywhere and 1024 on Qwen3-30B, Qwen3-235B, gpt-oss.")
for k in sorted(a):
    print(f"{k[0]:18s} M={k[1]:<5d} {a[k]:8.1f} {b.get(k, 0):8.1f} {c.get(k, 0):8.1f} {b.get(k, 0) / a[k]:6.3f} {c.get(k, 0) / a[k]:6.3f}")
PY
  for f in /tmp/kernels_*.txt; do echo "## $f (tools/profile_layer.sh)"; cat $f; done | tee -a $OUT/ab.txt
  # The layer's second groups launch: GEMM2's expand (the first is the join).
  bash "$0" source deepseek-v3-tp8 256 moe_lora_expand_groups_kernel 1
  ;;
peer)
  # Nsight Compute's sections for the peer's LoRA kernels (benchmarks/triton_moe_lora_peer_kernels.py) at MODEL and M,
  # with this GPU's searched configs: occupancy, registers, DRAM rate and warp states of the expand that runs 2.2-2.9x
  # faster than ours at M <= 1024 (dfb4c78; ours by groups at e89f6fd: 259 against 130.5 us at DeepSeek-V3 M = 1024). Its first lora_* launches are the correctness check's (the quick configs;
  # the same as the searched ones at DeepSeek-V3 M = 1024), then the timed graphs' (grid (blocks, N / BLOCK_N, slices)).
  model=${2:?model}; M=${3:?M}
  sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
    --section SchedulerStats --section MemoryWorkloadAnalysis"
  timeout 300 ncu --clock-control none --graph-profiling node -k regex:lora_ --launch-count 8 $sections \
    python3 benchmarks/triton_fused_moe_compare.py --model $model --tokens $M --lora-rank 16 --adapters 4 \
    --configs benchmarks/peer_configs/nvidia-h200.json --iters 3 > $OUT/peer_ncu_$M.txt 2>&1
  echo "peer ncu rc $? at $(el) s"
  grep -E "^  \S+_kernel|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Grid Size|Block Limit|Issued Warp Per|Dynamic Shared" \
    $OUT/peer_ncu_$M.txt | cut -c1-150 | tee $OUT/peer_digest_$M.txt
  ;;
source)
  # Nsight Compute's source page for one LoRA kernel (the first launch matching REGEX after SKIP) of MODEL's LoRA r16 layer at M:
  # where its warps stall and which of its instructions make the excess sectors and wavefronts (the text sections
  # give totals only: the join at Qwen3-30B M = 4096 had 53% excess global sectors, 36% excess shared wavefronts).
  # $OUT/source_<M>.ncu-rep (open in the UI) and source_<M>.csv, and the top instructions on stdout.
  model=${2:?model}; M=${3:?M}; regex=${4:?kernel regex}; skip=${5:-0}
  [ -x $B/moelora_bench ] || build
  timeout 200 ncu --clock-control none --graph-profiling node -k regex:$regex --launch-skip $skip --launch-count 1 --set full \
    --import-source yes -f -o $OUT/source_$M $B/moelora_bench --device cuda --iters 3 --no-check --model $model \
    --tokens $M --lora-rank 16 --adapters 4 > /tmp/ncu_source.log 2>&1; echo "ncu rc $? at $(el) s"; tail -3 /tmp/ncu_source.log
  ncu --import $OUT/source_$M.ncu-rep --page source --print-source sass --csv > $OUT/source_$M.csv 2>&1
  echo "source page rc $? ($(wc -l < $OUT/source_$M.csv) lines)"
  python3 - $OUT/source_$M.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next((i for i, r in enumerate(rows) if any("Source" in c for c in r) and len(r) > 5), None)
if head is None: sys.exit("no header: " + " | ".join(map(str, rows[:3])))
cols, body = rows[head], [r for r in rows[head + 1:] if len(r) == len(rows[head])]
print("columns:", " | ".join(cols))
def num(v):
    try: return float(v.replace(",", ""))
    except ValueError: return 0.0
src = next(i for i, c in enumerate(cols) if "Source" in c)
for key in ("Warp Stall Sampling (All", "L2 Theoretical Sectors Global Excessive", "L1 Wavefronts Shared Excessive"):
    idx = next((i for i, c in enumerate(cols) if c.startswith(key)), None)
    if idx is None: print("no column", key); continue
    print(f"## top 20 by {cols[idx]}")
    for r in sorted(body, key=lambda r: -num(r[idx]))[:20]:
        print(f"{num(r[idx]):12.0f}  {r[src][:110]}")
PY
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
*) echo "usage: bash docs/wip/issue31-next.sh ab | diag MODEL M [M...] | source MODEL M REGEX | peer MODEL M"; exit 2 ;;
esac
echo "done $(el) s"
