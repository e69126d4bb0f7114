#!/usr/bin/env bash
# Issue 31: what the alignment and the top-k sum cost inside the layer's CUDA graph at small M (their kernels overlap
# their neighbours through programmatic dependent launch, so ncu's serialised times overstate them). One cold call,
# carry .deps, ~330 s: applies docs/wip/issue31-repeat-align-sum.patch (measurement only: $MOELORA_EXTRA_ALIGN /
# $MOELORA_EXTRA_SUM launch the same idempotent kernel again), builds moelora_bench alone, then the base and LoRA r16
# grid at M = 1-256 with one extra alignment, one extra sum, and neither (twice), in one run. The layer's time with an
# extra launch minus without is that kernel's exposed cost (an upper bound on what a faster or fused one can save).
# $OUT/exposed.txt.
set -uo pipefail
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
B=/tmp/bx
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
git apply docs/wip/issue31-repeat-align-sum.patch || { echo "patch failed"; exit 1; }
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOELORA_CUDA=ON -DMOELORA_BUILD_PYTHON=OFF > /tmp/cfg.log 2>&1 ||
  { tail -30 /tmp/cfg.log; exit 1; }
cmake --build $B -j 16 --target moelora_bench > /tmp/build.log 2>&1 || { grep -B2 -A12 "error" /tmp/build.log | head -60; exit 1; }
echo "build $(el) s"
GRID="--device cuda --model ${MODELS:-all} --tokens ${TOKENS:-1,4,16,64,256} --lora-rank 0,16 --adapters 4 --lora-share 1.0 --no-check"
for run in def1 align sum def2; do
  case $run in align) env="MOELORA_EXTRA_ALIGN=1" ;; sum) env="MOELORA_EXTRA_SUM=1" ;; *) env="MOELORA_NONE=0" ;; esac
  env $env timeout 70 $B/moelora_bench $GRID --json /tmp/ex_$run.json > /tmp/ex_$run.log 2>&1
  echo "$run rc $? at $(el) s"
done
python3 - <<'PY' | tee $OUT/exposed.txt
import json, os
def rows(n):
    f = f"/tmp/ex_{n}.json"
    if not os.path.exists(f): return {}
    return {(r["model"], r["M"], (r.get("lora") or {}).get("rank", 0)): r["time_us"] for r in json.load(open(f))["rows"]}
d1, a, s, d2 = (rows(n) for n in ("def1", "align", "sum", "def2"))
print("## us; rank 0: the base layer. default: min of two rounds; +align / +sum: one more launch of that kernel, minus the default")
print(f"{'model':18s} {'M':>5s} {'rank':>4s} {'def1':>8s} {'def2':>8s} {'+align':>8s} {'+sum':>8s}")
for k in sorted(d1):
    d = min(d1[k], d2.get(k, 1e9))
    print(f"{k[0]:18s} {k[1]:5d} {k[2]:4d} {d1[k]:8.1f} {d2.get(k, 0):8.1f} {a.get(k, d) - d:8.1f} {s.get(k, d) - d:8.1f}")
PY
echo "done $(el) s"
