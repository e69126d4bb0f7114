#!/usr/bin/env bash
# Run on the device from the repository root, in two calls on one warm machine (one H200 or H100):
#   bash docs/wip/issue31-ab.sh build   (~400 s): build HEAD, time the decode cells, apply both wip patches, rebuild
#   bash docs/wip/issue31-ab.sh bench   (~350 s): time the patched decode cells, the grouped A/B at prefill, gtests
# The builds live in /tmp (kept between calls on a warm machine); the second call fails if the first left none.
# 1. docs/wip/issue31-late-wait-template.patch: the small-batch late delta wait as a template parameter of the 16-bit
#    kernels; their base instances compile to f1c8d20's PTX (e9db3ad's run-time branches changed the base codegen).
#    Prediction: base M = 4-8 on the small-expert models back to f1c8d20's (e9db3ad Qwen3-30B M = 4 84.2-84.7 us,
#    f1c8d20 82.2); LoRA M = 1-8 unchanged (+-0.5%).
# 2. docs/wip/issue31-grouped16.patch: the grouped CUTLASS GEMMs for 16-bit experts at prefill, --grouped off (the
#    registry's tiles) against on, checked (<= 128 tokens a cell against float64). Prediction: M = 1024-4096 on the
#    small-expert models 1.3-1.6x faster (the searched Triton peer's GEMMs are 1.1-1.75x faster than our tiles),
#    Mixtral M = 4096 ~1.2x; M = 256 slower.
set -uo pipefail
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
build() { MOELORA_JOBS=16 MOELORA_BUILD_DIR=$1 MOELORA_PTH=0 bash tools/build.sh -DMOELORA_CUDA=ON > /tmp/build.log 2>&1 || { grep -B2 -A12 "error" /tmp/build.log | head -60; exit 1; }; }
decode() {  # binary-dir label
  env ${3:-X=0} timeout 60 $1/moelora_bench --device cuda --model all --tokens 1,2,4,8,16 --lora-rank 16 --adapters 4 \
    --no-check --json /tmp/ab/$2.json > /tmp/ab/$2.log 2>&1
  echo "decode $2 rc $? at $(el) s"
}
mkdir -p /tmp/ab
case "${1:-}" in
build)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  build /tmp/b0; echo "build HEAD $(el) s"
  decode /tmp/b0 head
  git apply docs/wip/issue31-late-wait-template.patch && git apply docs/wip/issue31-grouped16.patch || { echo "patch failed"; exit 1; }
  build /tmp/b1; echo "build patched $(el) s"
  grep -i "spill" /tmp/build.log | grep -i "16bit\|small_batch" | head -6
  decode /tmp/b1 patched_1
  cp /tmp/ab/head.json /tmp/ab/patched_1.json $OUT/ ;;
bench)
  [ -x /tmp/b1/moelora_bench ] && [ -x /tmp/b0/moelora_bench ] || { echo "no builds: run 'build' first on this machine"; exit 1; }
  decode /tmp/b0 head_2; decode /tmp/b1 patched_2
  for g in off on; do
    timeout 130 /tmp/b1/moelora_bench --device cuda --model all --tokens 256,1024,2048,4096,8192 --grouped $g \
      --json /tmp/ab/g$g.json > /tmp/ab/g$g.log 2>&1
    echo "grouped $g rc $? at $(el) s"; grep -i "fail\|error" /tmp/ab/g$g.log | head -5
  done
  GTEST_FILTER='*grouped*:*small_batch*:*lora16_small_batch*:*CUDA_w4a16_lora_decode*' timeout 150 python3 tools/gtest_shards.py \
    --binary /tmp/b1/moelora_tests --shards 14 --gpus 1 --timeout 140 --junit $OUT/gtest.xml > $OUT/gtest.log 2>&1
  echo "patched gtests rc $? at $(el) s"; tail -2 $OUT/gtest.log
  python3 - <<'PY' | tee $OUT/ab.txt
import json
def load(n, key=lambda r: (r["model"], r["M"], bool(r.get("lora")))):
    try: return {key(r): r for r in json.load(open(f"/tmp/ab/{n}.json"))["rows"]}
    except Exception as e: print("missing", n, e); return {}
h1, h2, p2 = load("head"), load("head_2"), load("patched_2")
p1 = load("patched_1")
print("## decode, us: HEAD (two runs) / patched (two runs), patched/HEAD (means); LoRA r16, 4 adapters")
for k in sorted(h1):
    if k in p1 and k in h2 and k in p2:
        a = (h1[k]["time_us"] + h2[k]["time_us"]) / 2; b = (p1[k]["time_us"] + p2[k]["time_us"]) / 2
        print(f"{k[0]:18s} M={k[1]:<4d} {'lora' if k[2] else 'base'} {h1[k]['time_us']:8.1f} {h2[k]['time_us']:8.1f} "
              f"{p1[k]['time_us']:8.1f} {p2[k]['time_us']:8.1f} {b / a:6.3f}")
off, on = load("goff"), load("gon")
print("## bf16 layer at prefill, us: --grouped off (registry tiles) / on (CUTLASS grouped), on/off; % of floor; rel_err (on)")
for k in sorted(off):
    if k in on:
        x, y = off[k], on[k]
        print(f"{k[0]:18s} M={k[1]:<5d} {x['time_us']:9.1f} {y['time_us']:9.1f} {y['time_us'] / x['time_us']:6.3f}  "
              f"{x['pct_floor']:5.1f} {y['pct_floor']:5.1f}  {y.get('rel_err')}")
PY
  cp /tmp/ab/gon.json $OUT/grouped_on.json; cp /tmp/ab/goff.json $OUT/grouped_off.json ;;
*) echo "usage: bash docs/wip/issue31-ab.sh build|bench"; exit 2 ;;
esac
echo "done $(el) s"
