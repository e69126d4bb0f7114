#!/usr/bin/env bash
# The next lease's plan for docs/wip/issue31-expand-wide.patch on one warm H200 (or H100), carry .deps:
#   bash docs/wip/issue31-expand.sh ab     (~520 s cold): build main into /tmp/bl; the bf16 LoRA layer (r16, 4
#       adapters) at M = 256-4096 on every model and an ncu kernel list of Qwen3-30B's LoRA layer at M = 256 and
#       4096; apply the patch, rebuild (two TUs and the links); the same again. Prints the A/B table last.
#   bash docs/wip/issue31-expand.sh proof  (~450 s, warm): the whole C++ suite in 16 shards, pytest beside memcheck,
#       racecheck of the grouped LoRA tests
#   bash docs/wip/issue31-expand.sh grids  (~330 s, warm): the report's grids (bf16, bf16 LoRA, w4a16 LoRA, the
#       searched peer); make_report as in docs/wip/README.md
# The patch: moe_lora_expand_entries as 64 entries x 64 columns a CTA (both slices in the MMA's K), its index loads
# in one round trip, its output rows loaded before the MMAs, 16-byte accesses. The first version ran at ~12 ps an
# output element (0.33 TB/s of read-modify-write; fit over six models, reports/gpu/2026-11-29-h200x2-8dc7e77-issue31.txt).
# With it, GEMM1's shrink reads x by token (L2-resident) instead of the gathered rows: ~20-30 us at Qwen3-30B M = 4096
# (the ncu lists show the shrink kernel's time before and after).
# Prediction: the expand at 1.5-3 TB/s: LoRA layer M = 4096 Qwen3-30B 2342 -> ~1000-1100 us, DeepSeek-V3 5127 ->
# ~2100-2400, Mixtral 8336 -> ~5500-6000; M = 256 0.75-0.85x; rel_err unchanged (same fp32 sums, one rounding).
set -uo pipefail
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
B=/tmp/bl
build() {
  MOELORA_JOBS=16 MOELORA_BUILD_DIR=$B MOELORA_PTH=0 bash tools/build.sh -DMOELORA_CUDA=ON > /tmp/build.log 2>&1 ||
    { grep -B2 -A12 "error" /tmp/build.log | head -60; exit 1; }
  echo "build $(el) s"
}
lora_grid() {  # $1: json path
  timeout 150 $B/moelora_bench --device cuda --model all --tokens 256,1024,4096 --lora-rank 16 --adapters 4 \
    --lora-share 1.0 --json "$1" > "$1.log" 2>&1
  echo "lora grid rc $? at $(el) s"; tail -1 "$1.log"
}
kernels() {  # $1: tag, then the M: each kernel's time (ns) in Qwen3-30B's layer, base and LoRA rows
  local tag=$1; shift
  for m in "$@"; do
    timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-count 600 \
      $B/moelora_bench --device cuda --model qwen3-30b-a3b --tokens $m --lora-rank 16 --adapters 4 --no-check \
      --iters 3 > /tmp/ncu_${tag}_$m.csv 2>/dev/null
    echo "ncu $tag M=$m rc $? at $(el) s"
  done
}
case "${1:-}" in
ab)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  [ -x $B/moelora_bench ] || build
  lora_grid /tmp/before.json
  kernels before 4096
  git apply docs/wip/issue31-expand-wide.patch || { echo "patch failed"; exit 1; }
  cmake --build $B -j 16 > /tmp/rebuild.log 2>&1 || { grep -B2 -A12 "error" /tmp/rebuild.log | head -60; exit 1; }
  echo "rebuild $(el) s"
  lora_grid /tmp/after.json
  kernels after 256 4096
  cp /tmp/before.json /tmp/after.json $OUT/
  python3 - <<'PY' | tee $OUT/ab.txt
import csv, glob, json, re, statistics
def load(n):
    try: return {(r["model"], r["M"], int((r.get("lora") or {}).get("rank", 0))): r for r in json.load(open(n))["rows"]}
    except Exception as e: print("missing", n, e); return {}
a, b = load("/tmp/before.json"), load("/tmp/after.json")
print("## bf16 us (CUDA-graph medians): main / with the patch; after/before; % of floor after; rel_err after")
for k in sorted(a):
    if k in b:
        x, y = a[k], b[k]
        print(f"{k[0]:18s} M={k[1]:<5d} {'lora' if k[2] else 'base'} {x['time_us']:9.1f} {y['time_us']:9.1f} "
              f"{y['time_us'] / x['time_us']:6.3f} {y['pct_floor']:5.1f} {y.get('rel_err')}")
print("## ncu, Qwen3-30B LoRA r16: median ns per kernel name (base and LoRA rows both profiled: the LoRA kernels'")
print("## names are their own; 'n' launches seen)")
for tag in ("before", "after"):
    for m in (256, 4096):
        times = {}
        try:
            lines = [l for l in open(f"/tmp/ncu_{tag}_{m}.csv") if l.startswith('"')]
            for row in csv.DictReader(lines):
                if row.get("Metric Name") == "gpu__time_duration.sum":
                    name = re.sub(r"\(.*", "", row["Kernel Name"]).replace("void ", "")[:70]
                    times.setdefault(name, []).append(float(row["Metric Value"].replace(",", "")))
        except Exception as e:
            print(tag, m, "no ncu rows:", e); continue
        for name, v in sorted(times.items(), key=lambda kv: -statistics.median(kv[1])):
            print(f"{tag:6s} M={m:<5d} {statistics.median(v):10.0f} n={len(v):<3d} {name}")
PY
  ;;
proof)
  # The binaries 'ab' built with the patch (a fresh tree's new file times would make ninja rebuild everything).
  [ -x $B/moelora_tests ] || { echo "run 'ab' first"; exit 1; }
  timeout 200 python3 tools/gtest_shards.py --binary $B/moelora_tests --shards 16 --gpus 1 --timeout 190 \
    --junit $OUT/ctest.xml > /tmp/shards.log 2>&1
  echo "shards rc $? at $(el) s"; tail -2 /tmp/shards.log
  export MOELORA_EXT_DIR=$B PYTHONPATH=$PWD/python
  timeout 200 python3 -m pytest tests/python -q -n 14 --junitxml=$OUT/pytest.xml > /tmp/pytest.log 2>&1 &
  PY=$!
  timeout 190 compute-sanitizer --tool memcheck --error-exitcode 9 $B/moelora_tests \
    --gtest_filter='Shapes/FusedMoeTest.*:All/FusedExpertsLoraTest.*:*lora16_small_batch:*grouped16*' \
    > /tmp/memcheck.log 2>&1
  echo "memcheck rc $? at $(el) s"; grep -E "ERROR SUMMARY|PASSED|FAILED" /tmp/memcheck.log | tail -2
  tail -c 20000 /tmp/memcheck.log > $OUT/memcheck.log
  wait $PY; echo "pytest rc $? at $(el) s"; tail -1 /tmp/pytest.log
  # The new expand's shared memory under racecheck (its tiles, the staging, the masks).
  timeout $(( 585 - $(el) )) compute-sanitizer --tool racecheck --error-exitcode 9 $B/moelora_tests \
    --gtest_filter='All/FusedExpertsLoraTest.*grouped16_rank*:All/FusedExpertsLoraTest.*grouped16_m64*' \
    > /tmp/racecheck.log 2>&1
  echo "racecheck rc $? at $(el) s"; grep -E "RACECHECK SUMMARY|ERROR SUMMARY|PASSED|FAILED" /tmp/racecheck.log | tail -2
  tail -c 6000 /tmp/racecheck.log > $OUT/racecheck.log
  ;;
grids)
  [ -x $B/moelora_bench ] || { echo "run 'ab' first"; exit 1; }
  timeout 60 $B/moelora_bench --device cuda --model all --tokens 1,2,4,8,16,32,64,256,1024,4096 --ceilings \
    --json $OUT/bench.json > /tmp/bench.log 2>&1; echo "bf16 rc $? at $(el) s"
  timeout 50 $B/moelora_bench --device cuda --model all --tokens 1,4,16,64,256,1024,4096 --lora-rank 16 --adapters 4 \
    --lora-share 1.0 --no-check --ceilings --json $OUT/lorabf16.json > /tmp/lorabf16.log 2>&1
  echo "bf16 lora rc $? at $(el) s"
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
