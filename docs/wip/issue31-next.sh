#!/usr/bin/env bash
# The next lease's A/B of docs/wip/issue31-lora-index-math.patch (branch wip/lora-index-math) on one warm H200 (or H100),
# carry .deps, one call (~550 s cold):
#   bash docs/wip/issue31-next.sh ab: build main into /tmp/bl; the bf16 LoRA grid (r16, 4 adapters, M = 256-4096,
#       every model) unchecked; Qwen3-30B's LoRA layer kernel by kernel at M = 256 (main; tools/profile_layer.sh); apply the patch,
#       rebuild (two TUs); the grid checked against float64, and unchecked with the
#       expands unstreamed (the run-length rule's A/B after the change); the kernels at M = 256 and 4096 (patched).
#       Prints the A/B last.
# Then, if it wins: land the patch, and docs/wip/lease-proof.sh tests / grids on the same warm machine.
# The patch (index math out of the per-element loops, estimated from the code, not measured; no SASS here):
#  - expands: a lora_b tile copy took, for each pair and each 16-byte copy, two runtime divisions (row and run), the
#    column and its slice (a 64-bit division) and the address (~200 instructions a copy; ~10 pairs a tile at
#    M = 256). Now the slice and row offset are computed once a column tile, a pair's copies are a pointer and a
#    compare each. The join at M = 4096: 6,336 column tiles x 4 warps x ~3,000 instructions ~ 80 M warp
#    instructions, ~220 us at 1.5 IPC an SM (measured 253 us at 0.6 TB/s); ~1,400 of the 3,000 are these copies.
#  - segmented shrink: writing t took three runtime divisions an element (~90 instructions, 32 elements a thread
#    in a pass of 4 runs at rank 16, ~3 passes a tile at M = 256, 8 K splits a group). Now a thread keeps one
#    column of the pass and walks its rows.
# Prediction (Qwen3-30B LoRA r16): M = 256 599 -> ~480 us (expands ~150 -> ~40, shrinks -10..-30), M = 4096
# 1299 -> ~1150 (join 253 -> ~150, GEMM2's expand 141 -> ~90). rel_err unchanged (same sums, same roundings).
set -uo pipefail
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
B=/tmp/bl
lora_grid() {  # $1: json path, then moelora_bench's extra flags
  local json=$1; shift
  timeout 150 $B/moelora_bench --device cuda --model all --tokens 256,1024,4096 --lora-rank 16 --adapters 4 \
    --lora-share 1.0 --json "$json" "$@" > "$json.log" 2>&1
  echo "lora grid $json rc $? at $(el) s"; tail -1 "$json.log"
}
kernels() {  # $1: M, $2: output text; the project's per-kernel profile (tools/profile_layer.sh, ncu_summary.py)
  timeout 50 bash tools/profile_layer.sh $B moelora_bench --model qwen3-30b-a3b --tokens $1 --lora-rank 16 \
    --adapters 4 > $2 2>&1
  echo "kernels M=$1 rc $? at $(el) s"
}
case "${1:-}" in
ab)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  MOELORA_JOBS=16 MOELORA_BUILD_DIR=$B MOELORA_PTH=0 bash tools/build.sh -DMOELORA_CUDA=ON > /tmp/build.log 2>&1 ||
    { grep -B2 -A12 "error" /tmp/build.log | head -60; exit 1; }
  echo "build $(el) s"
  lora_grid /tmp/main.json --no-check
  kernels 256 /tmp/kernels_main_256.txt
  git apply docs/wip/issue31-lora-index-math.patch || { echo "patch failed"; exit 1; }
  cmake --build $B -j 16 > /tmp/rebuild.log 2>&1 || { grep -B2 -A12 "error" /tmp/rebuild.log | head -60; exit 1; }
  echo "rebuild $(el) s"
  lora_grid /tmp/patched.json
  MOELORA_LORA_EXPAND_STREAM=0 lora_grid /tmp/patched_rounds.json --no-check
  kernels 256 /tmp/kernels_patched_256.txt
  kernels 4096 /tmp/kernels_patched_4096.txt
  cp /tmp/main.json /tmp/patched.json /tmp/patched_rounds.json $OUT/
  python3 - <<'PY' | tee $OUT/ab.txt
import json
def load(n):
    try: return {(r["model"], r["M"], int((r.get("lora") or {}).get("rank", 0))): r for r in json.load(open(n))["rows"]}
    except Exception as e: print("missing", n, e); return {}
a, b, r = load("/tmp/main.json"), load("/tmp/patched.json"), load("/tmp/patched_rounds.json")
print("## bf16 us (CUDA-graph medians): main / + index math / + index math with MOELORA_LORA_EXPAND_STREAM=0;")
print("## each / main; % of floor and rel_err (patched, default, against float64)")
for k in sorted(a):
    if k in b:
        x, y, z = a[k]["time_us"], b[k]["time_us"], r.get(k, {}).get("time_us", float("nan"))
        print(f"{k[0]:18s} M={k[1]:<5d} {'lora' if k[2] else 'base'} {x:8.1f} {y:8.1f} {z:8.1f} {y / x:6.3f} {z / x:6.3f} "
              f"{b[k]['pct_floor']:5.1f} {b[k].get('rel_err')}")
PY
  for tag in main_256 patched_256 patched_4096; do
    echo "## kernels, Qwen3-30B LoRA r16 (4 adapters), $tag (tools/profile_layer.sh)"; cat /tmp/kernels_$tag.txt
  done | tee -a $OUT/ab.txt
  ;;
*) echo "usage: bash docs/wip/issue31-next.sh ab"; exit 2 ;;
esac
echo "done $(el) s"
