#!/usr/bin/env bash
# On a GPU machine with no package registry: builds everything with the CUDA backend,
# runs all C++ and Python tests (CUDA ones included), measures the copy and bf16 matmul
# ceilings (and the fp8/int8 GEMM rates), benchmarks the MoE layer over the brief's
# workloads, bf16 and 8-bit experts, and writes the JSON report of DESIGN.md ("GPU
# reports") to ${OUT:-reports/gpu}/.
#   MOELORA_COMMIT   sha of the code measured (the device copy has no .git)
#   BENCH_TOKENS     token counts for the grid (default: the brief's, 1 to 8192)
#   BENCH_MODELS     model name or "all" (default all); "none" skips the layer bench
#   SKIP_MLA=1       skip the sparse MLA decode bench (sparse_mla_bench, the issue's grid)
#                    and its kv-row gather ceiling (kv_gather_ceiling, a text table)
#   SANITIZE_FILTER  gtest filter run under compute-sanitizer memcheck and racecheck
#   SANITIZE_SWEEP=1 the whole CUDA suite under memcheck, racecheck, initcheck and synccheck
#                    (with SKIP_TESTS=1 too: SKIP_TESTS=1 SKIP_BENCH=1 SANITIZE_SWEEP=1 is a sweep call)
#                    (tools/sanitizer_sweep.py: batches within SWEEP_BUDGET seconds, default
#                    540, continuing SWEEP_STATE, default reports/gpu/sanitizer_state.json;
#                    commit $OUT/sanitizer_state.json back there to continue next call;
#                    SWEEP_JOBS sanitizer processes at once, default 8; SWEEP_GPUS devices
#                    they take in turn, default 1)
#   SKIP_TESTS=1     build and benchmark only; TEST_RESULTS=DIR then takes ctest.xml,
#                    pytest.xml and sanitizer_*.log from an earlier SKIP_BENCH=1 run
#   SKIP_BENCH=1     build and test only (the device allows 10 minutes a command)
#   CTEST_JOBS       ctest -j (default 16: the whole suite in ~5.3 min on the H100 machine)
#   TEST_SHARDS      if set (e.g. 24): the C++ suite as that many gtest shards spread over
#                    the GPUs instead of ctest (tools/gtest_shards.py; one merged JUnit file)
#   PYTEST_WORKERS   pytest-xdist processes where installed (default 8; 0: one process)
#   TUNE_TOKENS      if set: tune tiles at these token counts first, write the tables to
#                    $OUT/configs, and benchmark with them ($MOELORA_CONFIG_DIR); copy
#                    them to configs/ to ship them
#   LORA_RANKS       if set (e.g. "16,64"): also time the layer with LoRA at these ranks
#                    in every cell (moelora_bench --lora-rank) and report the LoRA tax;
#                    LORA_ADAPTERS (--adapters, default 4) and LORA_SHARE (--lora-share,
#                    default 1.0) are passed through. Each rank adds a timed and checked
#                    row per cell: narrow BENCH_TOKENS/BENCH_MODELS to fit 10 minutes.
#   QUANT_SCHEMES    8-bit experts (quant_bench --scheme; default
#                    "fp8_block,fp8_channel,fp8_tensor,int8_channel"; "none" skips) over
#                    QUANT_MODELS (default all) and QUANT_TOKENS (default
#                    1,2,4,8,16,32,64,256,1024,4096,8192), with the fp8/int8 ceilings;
#                    QUANT_LORA_RANKS (e.g. "16") adds LoRA rows to the fp8_block cells.
#                    Another grid of its own: with the layer bench, split the run
#                    (BENCH_MODELS=none QUANT_SCHEMES=none) to fit 10 minutes.
#   BF16_PEER=1      also time the same-run Triton peer of the bf16 layer (benchmarks/
#                    triton_fused_moe_compare.py over BENCH_MODELS/BENCH_TOKENS, config
#                    searched per cell; PEER_QUICK=1: one heuristic config), and with
#                    LORA_RANKS the LoRA layer at the first rank (its four LoRA kernels):
#                    peer_us in the bench's base and LoRA rows.
#   QUANT_PEER=1     also time the same-run Triton fp8 peer (benchmarks/
#                    triton_fused_moe_compare.py --quick, fp8_block and fp8_channel over
#                    QUANT_MODELS/QUANT_TOKENS; about 45 s for the whole grid on an H100):
#                    its two-GEMM times go into the quant rows as peer_us.
# CUTLASS headers must be in .deps/cutlass (tools/install_deps.sh here, then carry .deps).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT:-reports/gpu}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
BUILD_DIR=${MOELORA_BUILD_DIR:-build-gpu}
LOG="$OUT_DIR/gpu_report.log"
: > "$LOG"
step() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

step build
MOELORA_BUILD_DIR=$BUILD_DIR bash tools/build.sh -DMOELORA_CUDA=ON >>"$LOG" 2>&1 || { tail -50 "$LOG"; exit 1; }
grep -E "spill|lmem" "$LOG" | grep -v " 0 bytes" | head -5

if [ "${SKIP_TESTS:-0}" != 1 ]; then
step ctest
if [ -n "${TEST_SHARDS:-}" ]; then
  # The same cases as gtest shards over every GPU (tools/gtest_shards.py): 134 s for the whole
  # suite on 2 H200s, where ctest -j28 ran 1594 of 1661 cases in 330 s.
  python3 tools/gtest_shards.py --binary "$BUILD_DIR/moelora_tests" --shards "$TEST_SHARDS" \
    --gpus "$(nvidia-smi -L | wc -l)" --junit "$OUT_DIR/ctest.xml" >>"$LOG" 2>&1
else
  ctest --test-dir "$BUILD_DIR" -j "${CTEST_JOBS:-16}" --output-on-failure --output-junit "$OUT_DIR/ctest.xml" >>"$LOG" 2>&1
fi
tail -3 "$LOG"

step pytest
# pytest-xdist, where installed (the device image has it): the suite in PYTEST_WORKERS
# processes (default 8; 0 runs it in one). One process took 135 s on the H100 machine.
PYTEST_PARALLEL=()
if [ "${PYTEST_WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
  PYTEST_PARALLEL=(-n "${PYTEST_WORKERS:-8}")
fi
# --durations: the slowest tests in the log (at b56ac77 a run reached [100%] but had not exited
# 170 s in; docs/perf_notes/issues-31-33.md).
# TORCHINDUCTOR_COMPILE_THREADS=1: inductor compiles in-process rather than through a pool of
# compile workers in every xdist worker (a guess at that slow exit, not confirmed).
MOELORA_EXT_DIR="$PWD/$BUILD_DIR" PYTHONPATH="$PWD/python" TORCHINDUCTOR_COMPILE_THREADS=1 \
  python3 -m pytest tests/python -q -rs "${PYTEST_PARALLEL[@]}" --durations=15 --junitxml="$OUT_DIR/pytest.xml" >>"$LOG" 2>&1
tail -3 "$LOG"

if [ -n "${SANITIZE_FILTER:-}" ]; then
  for tool in memcheck racecheck; do
    step "compute-sanitizer $tool"
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$BUILD_DIR/moelora_tests" --gtest_filter="$SANITIZE_FILTER" \
      >"$OUT_DIR/sanitizer_$tool.log" 2>&1
    echo "$tool rc=$?" | tee -a "$LOG"; tail -2 "$OUT_DIR/sanitizer_$tool.log"
  done
fi
fi

if [ "${SANITIZE_SWEEP:-0}" = 1 ]; then
  # The whole CUDA suite under the four tools, resumable: SWEEP_STATE (default the
  # committed reports/gpu/sanitizer_state.json) is continued for SWEEP_BUDGET seconds.
  # Also with SKIP_TESTS=1 (a call of its own: SKIP_TESTS=1 SKIP_BENCH=1 SANITIZE_SWEEP=1).
  step "compute-sanitizer sweep"
  SWEEP_ARGS=()
  [ -f "${SWEEP_STATE:-reports/gpu/sanitizer_state.json}" ] && SWEEP_ARGS+=(--state "${SWEEP_STATE:-reports/gpu/sanitizer_state.json}")
  python3 tools/sanitizer_sweep.py --binary "$BUILD_DIR/moelora_tests" --budget "${SWEEP_BUDGET:-540}" --jobs "${SWEEP_JOBS:-8}" --gpus "${SWEEP_GPUS:-1}" \
    --commit "${MOELORA_COMMIT:-unknown}" --out "$OUT_DIR/sanitizer_state.json" --log-dir "$OUT_DIR" ${SWEEP_ARGS[@]+"${SWEEP_ARGS[@]}"} 2>&1 | tail -40 | tee -a "$LOG"
fi

if [ -n "${TEST_RESULTS:-}" ]; then
  cp "$TEST_RESULTS"/ctest.xml "$TEST_RESULTS"/pytest.xml "$TEST_RESULTS"/sanitizer_*.log "$OUT_DIR"/ 2>/dev/null
fi
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0

if [ -n "${TUNE_TOKENS:-}" ]; then
  step tune
  mkdir -p "$OUT_DIR/configs"
  "$BUILD_DIR/moelora_bench" --device cuda --model "${BENCH_MODELS:-all}" --tokens "$TUNE_TOKENS" \
    --tune "$OUT_DIR/configs" 2>&1 | tee -a "$LOG"
  export MOELORA_CONFIG_DIR="$OUT_DIR/configs"
fi

LORA_ARGS=()
[ -n "${LORA_RANKS:-}" ] && LORA_ARGS+=(--lora-rank "$LORA_RANKS")
[ -n "${LORA_ADAPTERS:-}" ] && LORA_ARGS+=(--adapters "$LORA_ADAPTERS")
[ -n "${LORA_SHARE:-}" ] && LORA_ARGS+=(--lora-share "$LORA_SHARE")

BENCH_JSONS=()
if [ "${BENCH_MODELS:-all}" != none ]; then
  step bench
  "$BUILD_DIR/moelora_bench" --device cuda --model "${BENCH_MODELS:-all}" \
    --tokens "${BENCH_TOKENS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192}" --ceilings --baseline \
    ${LORA_ARGS[@]+"${LORA_ARGS[@]}"} --json "$OUT_DIR/bench.json" 2>&1 | tee -a "$LOG"
  BENCH_JSONS+=("$OUT_DIR/bench.json")
fi
if [ "${QUANT_SCHEMES:-}" != none ]; then
  step quant_bench
  QUANT_LORA_ARGS=()
  [ -n "${QUANT_LORA_RANKS:-}" ] && QUANT_LORA_ARGS+=(--lora-rank "$QUANT_LORA_RANKS")
  rm -f "$OUT_DIR/quant.json"
  "$BUILD_DIR/quant_bench" --device cuda --model "${QUANT_MODELS:-all}" \
    --scheme "${QUANT_SCHEMES:-fp8_block,fp8_channel,fp8_tensor,int8_channel}" \
    --tokens "${QUANT_TOKENS:-1,2,4,8,16,32,64,256,1024,4096,8192}" --ceilings \
    ${QUANT_LORA_ARGS[@]+"${QUANT_LORA_ARGS[@]}"} --json "$OUT_DIR/quant.json" 2>&1 | tee -a "$LOG"
  # It writes the rows that ran even when some failed (and says which, exit 1).
  [ -f "$OUT_DIR/quant.json" ] && BENCH_JSONS+=("$OUT_DIR/quant.json")
fi
PEER_FILES=()
if [ "${BF16_PEER:-0}" = 1 ] && [ "${BENCH_MODELS:-all}" != none ]; then
  step triton_bf16_peer
  PEER_LORA=()
  [ -n "${LORA_RANKS:-}" ] && PEER_LORA+=(--lora-rank "${LORA_RANKS%%,*}" --adapters "${LORA_ADAPTERS:-4}" \
    --lora-share "${LORA_SHARE:-1.0}")
  MOELORA_EXT_DIR="$PWD/$BUILD_DIR" PYTHONPATH="$PWD/python" python3 benchmarks/triton_fused_moe_compare.py \
    --model "${BENCH_MODELS:-all}" --scheme bf16 --tokens "${BENCH_TOKENS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192}" \
    ${PEER_QUICK:+--quick} ${PEER_LORA[@]+"${PEER_LORA[@]}"} --json "$OUT_DIR/peer_bf16.json" 2>&1 | tee -a "$LOG"
  [ -f "$OUT_DIR/peer_bf16.json" ] && PEER_FILES+=("$OUT_DIR/peer_bf16.json")
fi
if [ "${QUANT_PEER:-0}" = 1 ]; then
  step triton_fp8_peer
  MOELORA_EXT_DIR="$PWD/$BUILD_DIR" PYTHONPATH="$PWD/python" python3 benchmarks/triton_fused_moe_compare.py \
    --model "${QUANT_MODELS:-all}" --scheme fp8_block,fp8_channel --quick \
    --tokens "${QUANT_TOKENS:-1,2,4,8,16,32,64,256,1024,4096,8192}" --json "$OUT_DIR/peer.json" 2>&1 | tee -a "$LOG"
  [ -f "$OUT_DIR/peer.json" ] && PEER_FILES+=("$OUT_DIR/peer.json")
fi
PEER_ARGS=()
[ ${#PEER_FILES[@]} -gt 0 ] && PEER_ARGS+=(--peer "${PEER_FILES[@]}")
if [ "${SKIP_MLA:-0}" != 1 ]; then
  step sparse_mla_bench
  "$BUILD_DIR/sparse_mla_bench" --device cuda --ceilings --json "$OUT_DIR/sparse_mla.json" 2>&1 | tee -a "$LOG"
  BENCH_JSONS+=("$OUT_DIR/sparse_mla.json")
  step kv_gather_ceiling
  "$BUILD_DIR/kv_gather_ceiling" 2>&1 | tee "$OUT_DIR/kv_gather_ceiling.txt" | tee -a "$LOG"
fi

step report
python3 tools/make_report.py --commit "${MOELORA_COMMIT:-unknown}" --ctest "$OUT_DIR/ctest.xml" \
  --pytest "$OUT_DIR/pytest.xml" --bench "${BENCH_JSONS[@]}" \
  --sanitizer-logs "$OUT_DIR"/sanitizer_*.log ${PEER_ARGS[@]+"${PEER_ARGS[@]}"} \
  $( [ -f "$OUT_DIR/sanitizer_state.json" ] && echo --sanitizer-state "$OUT_DIR/sanitizer_state.json" ) \
  --out "$OUT_DIR/report.json"
