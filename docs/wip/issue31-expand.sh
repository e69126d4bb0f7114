#!/usr/bin/env bash
# The next lease's plan for docs/wip/issue31-lora-prefill.patch on one warm H200 (or H100), carry .deps, three calls
# within 30 s of each other:
#   bash docs/wip/issue31-expand.sh ab     (~480 s cold): build main into /tmp/bl; the bf16 LoRA layer (r16, 4
#       adapters) at M = 256-4096 on every model; apply the patch, rebuild (three TUs and the links); the same grid
#       with MOELORA_LORA_EXPAND_ACTIVATION=0 (the wide expand alone) and with the default (the expand of GEMM1
#       joined to the activation). Prints the A/B table last.
#   bash docs/wip/issue31-expand.sh proof  (~500 s, warm): the whole C++ suite in 16 shards, pytest beside memcheck,
#       racecheck of the grouped LoRA tests, ncu's kernel list of Qwen3-30B's LoRA layer at M = 256 and 4096
#   bash docs/wip/issue31-expand.sh grids  (~400 s, warm): the report's grids (bf16, bf16 LoRA r16 and r64, r16 at
#       share 0.5, w4a16 LoRA, the searched peer at r16); make_report as in docs/wip/README.md
# The patch (branch wip/expand-activation):
#  - moe_lora_expand_entries as 64 entries x 64 columns a CTA (both slices in the MMA's K), its index loads in one
#    round trip, its output rows loaded before the MMAs, 16-byte accesses. The first version ran at ~12 ps an output
#    element (0.33 TB/s of read-modify-write; fit over six models, reports/gpu/2026-11-29-h200x2-8dc7e77-issue31.txt).
#  - GEMM1's shrink on the grouped path reads x by token (L2-resident) instead of the gathered rows.
#  - moe_lora_expand_activation: GEMM1's expand and the activation in one kernel (GEMM1's rows not written back).
# Prediction: the wide expand at 1.5-3 TB/s: LoRA M = 4096 Qwen3-30B 2342 -> ~1000-1100 us, DeepSeek-V3 5127 ->
# ~2100-2400, Mixtral 8336 -> ~5500-6000; M = 256 0.75-0.85x. The activation join a further 0.95-0.97x at M = 4096
# (GEMM1's [entries, 2I] written and read once less: 200 MB at Qwen3-30B, ~50 us). rel_err unchanged.
set -uo pipefail
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
B=/tmp/bl
build() {
  MOELORA_JOBS=16 MOELORA_BUILD_DIR=$B MOELORA_PTH=0 bash tools/build.sh -DMOELORA_CUDA=ON > /tmp/build.log 2>&1 ||
    { grep -B2 -A12 "error" /tmp/build.log | head -60; exit 1; }
  echo "build $(el) s"
}
lora_grid() {  # $1: json path, then moelora_bench's extra flags
  local json=$1; shift
  timeout 150 $B/moelora_bench --device cuda --model all --tokens 256,1024,4096 --lora-rank 16 --adapters 4 \
    --lora-share 1.0 --json "$json" "$@" > "$json.log" 2>&1
  echo "lora grid $json rc $? at $(el) s"; tail -1 "$json.log"
}
case "${1:-}" in
ab)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  [ -x $B/moelora_bench ] || build
  lora_grid /tmp/main.json
  git apply docs/wip/issue31-lora-prefill.patch || { echo "patch failed"; exit 1; }
  cmake --build $B -j 16 > /tmp/rebuild.log 2>&1 || { grep -B2 -A12 "error" /tmp/rebuild.log | head -60; exit 1; }
  grep -i "spill" /tmp/rebuild.log | grep -v " 0 bytes spill" | grep -i "lora" | head -4
  echo "rebuild $(el) s"
  export MOELORA_LORA_EXPAND_ACTIVATION=0
  lora_grid /tmp/wide.json --no-check
  unset MOELORA_LORA_EXPAND_ACTIVATION
  lora_grid /tmp/joined.json
  cp /tmp/main.json /tmp/wide.json /tmp/joined.json $OUT/
  python3 - <<'PY' | tee $OUT/ab.txt
import json
def load(n):
    try: return {(r["model"], r["M"], int((r.get("lora") or {}).get("rank", 0))): r for r in json.load(open(n))["rows"]}
    except Exception as e: print("missing", n, e); return {}
a, b, c = load("/tmp/main.json"), load("/tmp/wide.json"), load("/tmp/joined.json")
print("## bf16 us (CUDA-graph medians): main / wide expand (MOELORA_LORA_EXPAND_ACTIVATION=0) / joined (default);")
print("## wide/main, joined/main; % of floor (joined); rel_err (joined, <= 128 tokens against float64)")
for k in sorted(a):
    if k in b and k in c:
        x, y, z = a[k]["time_us"], b[k]["time_us"], c[k]["time_us"]
        print(f"{k[0]:18s} M={k[1]:<5d} {'lora' if k[2] else 'base'} {x:9.1f} {y:9.1f} {z:9.1f} {y / x:6.3f} {z / x:6.3f} "
              f"{c[k]['pct_floor']:5.1f} {c[k].get('rel_err')}")
PY
  ;;
proof)
  # The binaries 'ab' built with the patch (a fresh tree's new file times would make ninja rebuild everything).
  [ -x $B/moelora_tests ] || { echo "run 'ab' first"; exit 1; }
  timeout 200 python3 tools/gtest_shards.py --binary $B/moelora_tests --shards 16 --gpus 1 --timeout 190 \
    --junit $OUT/ctest.xml > /tmp/shards.log 2>&1
  echo "shards rc $? at $(el) s"; tail -2 /tmp/shards.log; grep -B2 -A8 "FAILED\|Failure" /tmp/shards.log | head -30
  export MOELORA_EXT_DIR=$B PYTHONPATH=$PWD/python
  timeout 200 python3 -m pytest tests/python -q -n 14 --junitxml=$OUT/pytest.xml > /tmp/pytest.log 2>&1 &
  PY=$!
  timeout 190 compute-sanitizer --tool memcheck --error-exitcode 9 $B/moelora_tests \
    --gtest_filter='Shapes/FusedMoeTest.*:All/FusedExpertsLoraTest.*:*lora16_small_batch:*grouped16*' \
    > /tmp/memcheck.log 2>&1
  echo "memcheck rc $? at $(el) s"; grep -E "ERROR SUMMARY|PASSED|FAILED" /tmp/memcheck.log | tail -2
  tail -c 20000 /tmp/memcheck.log > $OUT/memcheck.log
  wait $PY; echo "pytest rc $? at $(el) s"; tail -1 /tmp/pytest.log
  # The new kernels' shared memory under racecheck (tiles, staging, the groups' masks).
  timeout 70 compute-sanitizer --tool racecheck --error-exitcode 9 $B/moelora_tests \
    --gtest_filter='All/FusedExpertsLoraTest.*grouped16_rank*:All/FusedExpertsLoraTest.*grouped16_m64*:All/FusedExpertsLoraTest.*grouped16_swiglu_oai' \
    > /tmp/racecheck.log 2>&1
  echo "racecheck rc $? at $(el) s"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|PASSED|FAILED" /tmp/racecheck.log | tail -2
  tail -c 6000 /tmp/racecheck.log > $OUT/racecheck.log
  # Each kernel's time in Qwen3-30B's layer (base and LoRA rows: 600 launches cover both).
  for m in 256 4096; do
    timeout 45 ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-count 600 \
      $B/moelora_bench --device cuda --model qwen3-30b-a3b --tokens $m --lora-rank 16 --adapters 4 --no-check \
      --iters 3 > /tmp/ncu_$m.csv 2>/dev/null
    echo "ncu M=$m rc $? at $(el) s"
  done
  python3 - <<'PY' | tee $OUT/kernels.txt
import csv, re, statistics
print("## ncu, Qwen3-30B with LoRA r16 (4 adapters), the patched build: median ns per kernel name, launches seen")
for m in (256, 4096):
    times = {}
    try:
        lines = [l for l in open(f"/tmp/ncu_{m}.csv") if l.startswith('"')]
        for row in csv.DictReader(lines):
            if row.get("Metric Name") == "gpu__time_duration.sum":
                name = re.sub(r"\(.*", "", row["Kernel Name"]).replace("void ", "")[:90]
                times.setdefault(name, []).append(float(row["Metric Value"].replace(",", "")))
    except Exception as e:
        print(m, "no ncu rows:", e); continue
    for name, v in sorted(times.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"M={m:<5d} {statistics.median(v):10.0f} n={len(v):<3d} {name}")
PY
  ;;
grids)
  [ -x $B/moelora_bench ] || { echo "run 'ab' first"; exit 1; }
  timeout 60 $B/moelora_bench --device cuda --model all --tokens 1,2,4,8,16,32,64,256,1024,4096 --ceilings \
    --json $OUT/bench.json > /tmp/bench.log 2>&1; echo "bf16 rc $? at $(el) s"
  timeout 75 $B/moelora_bench --device cuda --model all --tokens 1,4,16,64,256,1024,4096 --lora-rank 16,64 --adapters 4 \
    --lora-share 1.0 --no-check --ceilings --json $OUT/lorabf16.json > /tmp/lorabf16.log 2>&1
  echo "bf16 lora rc $? at $(el) s"
  timeout 45 $B/moelora_bench --device cuda --model all --tokens 1,4,16,64,256,1024,4096 --lora-rank 16 --adapters 4 \
    --lora-share 0.5 --no-check --ceilings --json $OUT/lorahalf.json > /tmp/lorahalf.log 2>&1
  echo "bf16 lora share 0.5 rc $? at $(el) s"
  timeout 40 $B/quant_bench --device cuda --model all --scheme w4a16:g128 --tokens 16,256,1024 --lora-rank 16 \
    --ceilings --json $OUT/lora.json > /tmp/lora.log 2>&1; echo "w4a16 lora rc $? at $(el) s"
  mkdir -p /tmp/peer
  for m in qwen3-30b-a3b olmoe-1b-7b deepseek-v3-tp8 mixtral-8x7b qwen3-235b-a22b gpt-oss-120b; do
    left=$(( 560 - $(el) )); [ $left -gt 10 ] || break
    timeout $left python3 benchmarks/triton_fused_moe_compare.py --model $m --tokens 1,4,16,64,256,1024,4096 \
      --lora-rank 16 --adapters 4 --lora-share 1.0 --json /tmp/peer/$m.json >> /tmp/peer.log 2>&1
    echo "peer $m rc $? at $(el) s"
  done
  python3 -c "import glob, json; json.dump([r for f in sorted(glob.glob('/tmp/peer/*.json')) for r in json.load(open(f))], open('$OUT/peer.json', 'w'))"
  ;;
*) echo "usage: bash docs/wip/issue31-expand.sh ab|proof|grids"; exit 2 ;;
esac
echo "done $(el) s"
