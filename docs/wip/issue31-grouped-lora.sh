#!/usr/bin/env bash
# Run on the device from the repository root, in two calls on one warm machine (one H200 or H100):
#   bash docs/wip/issue31-grouped-lora.sh build   (~340 s): apply both patches, build, their gtests, memcheck
#   bash docs/wip/issue31-grouped-lora.sh bench   (~380 s): the LoRA layer on the grouped path against the fused
#       tiles; the base layer on 128 x 256 grouped tiles against the default (128 x 128 at these M)
# docs/wip/issue31-grouped-lora.patch: LoRA on the grouped CUTLASS GEMMs (16-bit experts): the segmented alignment
# (an expert's rows span its (expert, adapter) groups), each GEMM's shrink by entry (moe_lora_shrink) and the new
# expand by entry (moe_lora_expand_entries) after it. Its default: LoRA calls take the grouped path from the same
# rule as the base layer (grouped_16bit_min_slots).
# Prediction: LoRA r16 at M = 1024-4096 0.75-0.9x the fused tiles' time on every model (the base gained 0.7-0.9x;
# the expand's read-modify-write of [entries, N] costs ~5-8% of the layer); M = 256 level.
# docs/wip/issue31-grouped16-wide.patch (applies after the first): GroupedGemmTiles::kCooperative128x256 for 16-bit
# experts, --grouped-tiles. Prediction: 128x256 on both GEMMs 0.9-0.95x at M >= 2048 on the models with >= 128
# rows an expert (each A tile read once for 256 columns, CUTLASS's fastest dense bf16 shape), level or slower at
# M = 1024 on DeepSeek-V3 (32 rows an expert: a 128-row tile mostly padding either way).
set -uo pipefail
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
B=/tmp/bl
case "${1:-}" in
build)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  git apply docs/wip/issue31-grouped-lora.patch && git apply docs/wip/issue31-grouped16-wide.patch ||
    { echo "patch failed"; exit 1; }
  MOELORA_JOBS=16 MOELORA_BUILD_DIR=$B MOELORA_PTH=0 bash tools/build.sh -DMOELORA_CUDA=ON > /tmp/build.log 2>&1 ||
    { grep -B2 -A12 "error" /tmp/build.log | head -60; exit 1; }
  grep -i "spill" /tmp/build.log | grep -i "expand_entries\|lora" | head -4
  echo "build $(el) s"
  F='*grouped*:*FusedExpertsLora*:*LoraDelta*:*LoraAlign*:*FusedExpertsLayout*'
  GTEST_FILTER="$F" timeout 200 python3 tools/gtest_shards.py --binary $B/moelora_tests --shards 14 --gpus 1 \
    --timeout 190 --junit $OUT/gtest.xml > $OUT/gtest.log 2>&1
  echo "gtests rc $? at $(el) s"; tail -3 $OUT/gtest.log; grep -B2 -A8 "FAILED\|Failure" $OUT/gtest.log | head -40
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/moelora_tests \
    --gtest_filter='All/FusedExpertsLoraTest.*grouped16*' > /tmp/memcheck.log 2>&1
  echo "memcheck rc $? at $(el) s"; grep -E "ERROR SUMMARY|PASSED|FAILED" /tmp/memcheck.log | tail -3
  tail -c 20000 /tmp/memcheck.log > $OUT/memcheck.log ;;
bench)
  [ -x $B/moelora_bench ] || { echo "no build: run 'build' first on this machine"; exit 1; }
  T=256,1024,2048,4096
  timeout 120 $B/moelora_bench --device cuda --model all --tokens $T --lora-rank 16 --adapters 4 --grouped off \
    --no-check --json /tmp/off.json > /tmp/off.log 2>&1; echo "tiles rc $? at $(el) s"; tail -2 /tmp/off.log
  timeout 200 $B/moelora_bench --device cuda --model all --tokens $T --lora-rank 16 --adapters 4 \
    --json /tmp/on.json > /tmp/on.log 2>&1; echo "default (grouped) rc $? at $(el) s"; tail -2 /tmp/on.log
  for t in 128x256,128x256 128x256,128; do
    timeout 80 $B/moelora_bench --device cuda --model all --tokens 1024,2048,4096,8192 --grouped-tiles $t --no-check \
      --json /tmp/w$t.json > /tmp/w.log 2>&1; echo "tiles $t rc $? at $(el) s"; tail -1 /tmp/w.log
  done
  cp /tmp/off.json $OUT/lora_tiles.json; cp /tmp/on.json $OUT/lora_grouped.json
  python3 - <<'PY' | tee $OUT/ab.txt
import json
def load(n):
    try: return {(r["model"], r["M"], int((r.get("lora") or {}).get("rank", 0))): r for r in json.load(open(n))["rows"]}
    except Exception as e: print("missing", n, e); return {}
off, on = load("/tmp/off.json"), load("/tmp/on.json")
print("## us: --grouped off (registry tiles, fused LoRA) / default (grouped GEMMs, LoRA by entry), on/off; % of floor;"
      " rel_err (default, <= 128 tokens against float64)")
for k in sorted(off):
    if k in on:
        x, y = off[k], on[k]
        print(f"{k[0]:18s} M={k[1]:<5d} {'lora' if k[2] else 'base'} {x['time_us']:9.1f} {y['time_us']:9.1f} "
              f"{y['time_us'] / x['time_us']:6.3f}  {x['pct_floor']:5.1f} {y['pct_floor']:5.1f}  {y.get('rel_err')}")
w1, w2 = load("/tmp/w128x256,128x256.json"), load("/tmp/w128x256,128.json")
print("## base us: default (grouped, 128 x 128 from 32 slots an expert) / 128x256 both GEMMs / 128x256 GEMM1 only;"
      " ratios to the default")
for k in sorted(w1):
    if k in on and k in w2:
        d = on[k]["time_us"]
        print(f"{k[0]:18s} M={k[1]:<5d} {d:9.1f} {w1[k]['time_us']:9.1f} {w2[k]['time_us']:9.1f} "
              f"{w1[k]['time_us'] / d:6.3f} {w2[k]['time_us'] / d:6.3f}")
PY
  ;;
*) echo "usage: bash docs/wip/issue31-grouped-lora.sh build|bench"; exit 2 ;;
esac
echo "done $(el) s"
