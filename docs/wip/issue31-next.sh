#!/usr/bin/env bash
# Issue 31, the next lease (carry .deps; one nvidia-h200 or H100):
#   bash docs/wip/issue31-next.sh ab    (~540 s cold) applies docs/wip/issue31-expand-schedule.patch (the expands'
#       CTAs stream a stride of column tiles also at short runs where a streaming CTA would walk >= 16 of them;
#       MOELORA_LORA_EXPAND_STREAM 0/1/2 = never / the rule / always; the losing tile widths of dfb4c78's A/B and
#       their knobs removed) and docs/wip/issue31-expand-groups.patch (GEMM2's expand by 16-entry groups, a warp a
#       group's 32 columns, behind MOELORA_LORA_EXPAND_GROUPS=1; =2 the join too), builds into /tmp/bl, runs the
#       LoRA layer tests, then the bf16 LoRA r16 grid (4 adapters, share 1.0, M = 256, 1024, 4096, every model) by
#       the rule, never, by groups (=1) and by groups with the join (=2), and the kernels at DeepSeek-V3 M = 1024
#       (tiles, groups=2) and Qwen3-30B M = 1024 and 256 (groups=2); then docs/wip/issue31-shared-vectors.patch on
#       top (the expands' sums and the join's activation reads as 32-bit and 16-byte shared accesses), rebuilt, its
#       tests, its grid and the kernels at Qwen3-30B M = 4096. Prints the A/B.
#   (Earlier 'ab's: docs/wip/issue31-warp-tiles.patch in the forty-fourth session, docs/wip/issue31-narrow-expands.patch
#   in the forty-fifth (landed as dfb4c78); docs/perf_notes/issues-31-33.md.)
#   bash docs/wip/issue31-next.sh diag MODEL M [M...]   (~30 s warm) Nsight Compute's sections (speed of light,
#       launch, occupancy, warp states, memory, source counters) for the first launch of each LoRA kernel
#       (moe_lora_*) of MODEL's LoRA r16 layer at each M; $OUT/ncu_<M>.txt and a digest.
#   bash docs/wip/issue31-next.sh source MODEL M REGEX   (~60 s warm; not yet run) ncu's source page (SASS) of the first
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
  git apply docs/wip/issue31-expand-schedule.patch && git apply docs/wip/issue31-expand-groups.patch ||
    { echo "patches failed"; exit 1; }
  build
  tests='All/FusedExpertsLoraTest.*:All/LoraDeltaTest.*:Configs/FusedExpertsLoraCudaGraph.*:FusedExpertsLoraWarpTilesOff.*:FusedExpertsLoraExpandSchedules.*:FusedExpertsLoraExpandGroups.*'
  timeout 70 $B/moelora_tests --gtest_filter="$tests" > $OUT/tests.log 2>&1
  echo "LoRA tests rc $? at $(el) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]" $OUT/tests.log | head -20
  # Unchecked grids (~26 s each; the tests above check the kernels, lease-proof's grids check the layer).
  grid="--device cuda --model all --tokens 256,1024,4096 --lora-rank 16 --adapters 4 --lora-share 1.0 --no-check"
  for v in rule:MOELORA_LORA_EXPAND_STREAM=1 never:MOELORA_LORA_EXPAND_STREAM=0 groups:MOELORA_LORA_EXPAND_GROUPS=1 \
           groups2:MOELORA_LORA_EXPAND_GROUPS=2; do
    env ${v#*:} timeout 45 $B/moelora_bench $grid --json /tmp/${v%%:*}.json > /tmp/${v%%:*}.log 2>&1
    echo "${v%%:*} grid rc $? at $(el) s"
  done
  for cell in "0 deepseek-v3-tp8 1024" "2 deepseek-v3-tp8 1024" "2 qwen3-30b-a3b 1024" "2 qwen3-30b-a3b 256"; do
    set -- $cell
    MOELORA_LORA_EXPAND_GROUPS=$1 timeout 30 bash tools/profile_layer.sh $B \
      moelora_bench --model $2 --tokens $3 --lora-rank 16 --adapters 4 > /tmp/kernels_$1_$2_$3.txt 2>&1
    echo "kernels $1 $2 M=$3 rc $? at $(el) s"
  done
  # Then the shared-memory vectors (32-bit sums, 16-byte activation reads) on top: rebuild (one TU), tests, grid.
  git apply docs/wip/issue31-shared-vectors.patch || { echo "vectors patch failed"; exit 1; }
  build
  timeout 70 $B/moelora_tests --gtest_filter="$tests" > $OUT/tests_vectors.log 2>&1
  echo "LoRA tests (vectors) rc $? at $(el) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]" $OUT/tests_vectors.log | head
  timeout 45 $B/moelora_bench $grid --json /tmp/vectors.json > /tmp/vectors.log 2>&1; echo "vectors grid rc $? at $(el) s"
  timeout 30 bash tools/profile_layer.sh $B moelora_bench --model qwen3-30b-a3b --tokens 4096 --lora-rank 16 \
    --adapters 4 > /tmp/kernels_vectors_qwen3-30b-a3b_4096.txt 2>&1; echo "kernels (vectors) rc $? at $(el) s"
  tar czf $OUT/grids.tgz -C /tmp rule.json never.json groups.json groups2.json vectors.json
  python3 - <<'PY' | tee $OUT/ab.txt
import json
def load(n):
    try: return {(r["model"], r["M"], bool(r.get("lora"))): r for r in json.load(open(n))["rows"]}
    except Exception as e: print("missing", n, e); return {}
r, n, g, g2, v = (load(f"/tmp/{x}.json") for x in ("rule", "never", "groups", "groups2", "vectors"))
nan = float("nan")
print("## bf16 LoRA r16, 4 adapters (CUDA-graph medians, us): the expands' column tiles by the schedule patch's rule")
print("## (long runs, or >= 16 column tiles a streaming CTA) / one a CTA (=0) / the expands by 16-entry groups")
print("## (MOELORA_LORA_EXPAND_GROUPS=1) / and the join by groups (=2) / the rule with the shared vectors; rule / never,")
print("## groups / rule, groups2 / rule, vectors / rule; % of floor of the rule. Main's rule = never below a mean run")
print("## of 32 (M = 256 everywhere, 1024 but on OLMoE and Mixtral), = the rule at M = 4096.")
for k in sorted(r):
    if k in n and k[2]:
        x, y = n[k]["time_us"], r[k]["time_us"]
        z, gg, w = (d.get(k, {}).get("time_us", nan) for d in (g, g2, v))
        print(f"{k[0]:18s} M={k[1]:<5d} {y:8.1f} {x:8.1f} {z:8.1f} {gg:8.1f} {w:8.1f} {y / x:6.3f} {z / y:6.3f} "
              f"{gg / y:6.3f} {w / y:6.3f} {r[k]['pct_floor']:5.1f}")
PY
  for f in /tmp/kernels_*.txt; do echo "## $f (tools/profile_layer.sh)"; cat $f; done | tee -a $OUT/ab.txt
  ;;
peer)
  # Nsight Compute's sections for the peer's LoRA kernels (benchmarks/triton_moe_lora_peer_kernels.py) at MODEL and M,
  # with this GPU's searched configs: occupancy, registers, DRAM rate and warp states of the expand that runs 2.2-2.9x
  # faster than ours at M <= 1024 (dfb4c78). Its first lora_* launches are the correctness check's (the quick configs;
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
  # Nsight Compute's source page for one LoRA kernel (the first launch matching REGEX) of MODEL's LoRA r16 layer at M:
  # where its warps stall and which of its instructions make the excess sectors and wavefronts (the text sections
  # give totals only: the join at Qwen3-30B M = 4096 had 53% excess global sectors, 36% excess shared wavefronts).
  # $OUT/source_<M>.ncu-rep (open in the UI) and source_<M>.csv, and the top instructions on stdout.
  model=${2:?model}; M=${3:?M}; regex=${4:?kernel regex}
  [ -x $B/moelora_bench ] || build
  timeout 200 ncu --clock-control none --graph-profiling node -k regex:$regex --launch-count 1 --set full \
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
