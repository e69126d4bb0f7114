#!/usr/bin/env bash
# Run on the device from the repository root (one H200 or H100, ~420 s): issue 31 item 2, the grouped CUTLASS GEMMs
# for 16-bit experts (docs/wip/issue31-grouped16.patch), A/B in one build: moelora_bench --grouped off (the tiles the
# registry names) against --grouped on (the grouped path forced) at M = 256-8192 on every model, checked rows
# (<= 128 tokens a cell against the float64 reference), then the patched fused_experts / grouped gtests.
# Prediction (the searched Triton peer's two GEMMs, H200, e9db3ad's report): M = 1024-4096 on the small-expert models
# 1.3-1.6x faster (Qwen3-30B M = 4096 ~1104 -> ~700 us), Mixtral M = 4096 ~1.2x; M = 256 slower (few rows an expert).
set -uo pipefail
B=/tmp/b; t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git apply docs/wip/issue31-grouped16.patch || { echo "patch failed"; exit 1; }
MOELORA_JOBS=16 MOELORA_BUILD_DIR=$B MOELORA_PTH=0 bash tools/build.sh -DMOELORA_CUDA=ON > /tmp/build.log 2>&1 || { grep -B2 -A12 "error" /tmp/build.log | head -80; exit 1; }
grep -i "grouped_gemm_sm90.*spill\|16bit.*spill" /tmp/build.log | head -4
echo "build $(el) s"
GTEST_FILTER='*grouped*' timeout 120 $B/moelora_tests > $OUT/gtest.log 2>&1
echo "grouped gtests rc $? at $(el) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]" $OUT/gtest.log | head -20
T=256,1024,2048,4096,8192
for g in off on; do
  timeout 130 $B/moelora_bench --device cuda --model all --tokens $T --grouped $g --json /tmp/g$g.json > /tmp/g$g.log 2>&1
  echo "bench grouped $g rc $? at $(el) s"; grep -i "fail\|error" /tmp/g$g.log | head -5
done
python3 - <<'PY' | tee $OUT/ab.txt
import json
def load(n):
    try: return {(r["model"], r["M"]): r for r in json.load(open(f"/tmp/g{n}.json"))["rows"]}
    except Exception as e: print("missing", n, e); return {}
a, b = load("off"), load("on")
print("## bf16 layer, us: --grouped off (the registry's tiles) / on (the CUTLASS grouped GEMMs), on/off; % of floor; rel_err of 'on'")
for k in sorted(a):
    if k in b:
        x, y = a[k], b[k]
        print(f"{k[0]:18s} M={k[1]:<5d} {x['time_us']:9.1f} {y['time_us']:9.1f} {y['time_us'] / x['time_us']:6.3f}  "
              f"{x['pct_floor']:5.1f} {y['pct_floor']:5.1f}  {y.get('rel_err')}")
PY
cp /tmp/gon.json $OUT/grouped_on.json; cp /tmp/goff.json $OUT/grouped_off.json
echo "done $(el) s"
