#!/usr/bin/env bash
# The next lease's whole plan for issue 31 on one warm H200 (or H100), three calls (carry .deps):
#   bash docs/wip/issue31-next.sh tests   (~420 s): apply both wip patches (grouped LoRA, 128 x 256 tiles), build
#                                          into /tmp/bl, the whole C++ suite in 16 gtest shards
#   bash docs/wip/issue31-next.sh bench   (~450 s): the A/B tables (docs/wip/issue31-grouped-lora.sh bench), the
#                                          bf16 grid and the w4a16 LoRA rows
#   bash docs/wip/issue31-next.sh rest    (~480 s): the weight-only grid, the bf16 LoRA grid, the searched peer,
#                                          pytest on the GPU and memcheck
# The three calls' files make one report (tools/make_report.py, as in the last closing note) for the commit that
# lands the patches unchanged. A call that finds no build (a cold machine) builds first (~200 s more).
set -uo pipefail
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
B=/tmp/bl
[ -f src/cuda/moe_lora_expand_entries.cu ] || {
  git apply docs/wip/issue31-grouped-lora.patch && git apply docs/wip/issue31-grouped16-wide.patch ||
    { echo "patch failed"; exit 1; }
}
build() {
  MOELORA_JOBS=16 MOELORA_BUILD_DIR=$B MOELORA_PTH=0 bash tools/build.sh -DMOELORA_CUDA=ON > /tmp/build.log 2>&1 ||
    { grep -B2 -A12 "error" /tmp/build.log | head -60; exit 1; }
  echo "build $(el) s"
}
case "${1:-}" in
tests)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  build
  timeout 330 python3 tools/gtest_shards.py --binary $B/moelora_tests --shards 16 --gpus 1 --timeout 320 \
    --junit $OUT/ctest.xml > $OUT/shards.log 2>&1
  echo "shards rc $? at $(el) s"; tail -4 $OUT/shards.log ;;
bench)
  [ -x $B/moelora_bench ] || build
  bash docs/wip/issue31-grouped-lora.sh bench
  timeout 110 $B/moelora_bench --device cuda --model all --tokens 1,2,4,8,16,32,64,256,1024,4096 --ceilings \
    --json $OUT/bench.json > $OUT/bench.log 2>&1
  echo "bf16 bench rc $? at $(el) s"
  timeout $(( 590 - $(el) )) $B/quant_bench --device cuda --model all --scheme w4a16:g128 --tokens 16,256,1024 \
    --lora-rank 16 --ceilings --json $OUT/lora.json >> $OUT/bench.log 2>&1
  echo "w4a16 lora rc $? at $(el) s" ;;
rest)
  [ -x $B/quant_bench ] || build
  timeout 200 $B/quant_bench --device cuda --model all --scheme w4a16:g128,w4a16:g128:zp,w8a16:g0 \
    --tokens 1,2,4,8,16,32,64,256,1024,4096 --ceilings --json $OUT/quant.json > $OUT/quant.log 2>&1
  echo "quant rc $? at $(el) s"
  timeout 90 $B/moelora_bench --device cuda --model all --tokens 1,4,16,64,256,1024,4096 --lora-rank 16 --adapters 4 \
    --lora-share 1.0 --no-check --ceilings --json $OUT/lorabf16.json > $OUT/lorabf16.log 2>&1
  echo "bf16 lora rc $? at $(el) s"; tail -2 $OUT/lorabf16.log
  mkdir -p /tmp/peer
  for m in qwen3-30b-a3b olmoe-1b-7b deepseek-v3-tp8 mixtral-8x7b qwen3-235b-a22b gpt-oss-120b; do
    left=$(( 340 - $(el) )); [ $left -gt 10 ] || break
    timeout $left python3 benchmarks/triton_fused_moe_compare.py --model $m --tokens 1,4,16,64,256,1024,4096 \
      --lora-rank 16 --adapters 4 --lora-share 1.0 --json /tmp/peer/$m.json >> /tmp/peer.log 2>&1
    echo "peer $m rc $? at $(el) s"
  done
  python3 -c "import glob, json; json.dump([r for f in sorted(glob.glob('/tmp/peer/*.json')) for r in json.load(open(f))], open('$OUT/peer.json', 'w'))"
  export MOELORA_EXT_DIR=$B PYTHONPATH=$PWD/python
  timeout 220 python3 -m pytest tests/python -q -n 14 --junitxml=$OUT/pytest.xml > $OUT/pytest.log 2>&1 &
  PY=$!
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 $B/moelora_tests \
    --gtest_filter='Shapes/FusedMoeTest.*:All/FusedExpertsLoraTest.*:*CUDA_w4a16_lora_decode*:*lora16_small_batch:*grouped16*' \
    > /tmp/memcheck.log 2>&1
  echo "memcheck rc $? at $(el) s"; grep -E "ERROR SUMMARY|PASSED|FAILED" /tmp/memcheck.log | tail -3
  tail -c 20000 /tmp/memcheck.log > $OUT/memcheck.log
  wait $PY; echo "pytest rc $? at $(el) s"; tail -3 $OUT/pytest.log ;;
*) echo "usage: bash docs/wip/issue31-next.sh tests|bench|rest"; exit 2 ;;
esac
echo "done $(el) s"
