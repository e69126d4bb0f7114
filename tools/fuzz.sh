#!/usr/bin/env bash
# Fuzzes every public op's validation and the CPU backend behind it (issue 33): builds
# fuzz/fuzz_ops.cpp and the library with clang, libFuzzer, AddressSanitizer and UBSan
# into ${MOELORA_FUZZ_BUILD_DIR:-build-fuzz}, replays every committed input
# (fuzz/corpus: the seeds and what earlier runs kept; fuzz/regressions: inputs that once
# found a bug, each fixed), then fuzzes for SECONDS (default 120) on all cores.
#   tools/fuzz.sh [SECONDS]        0: replay only
#   MOELORA_FUZZ_KEEP=1            add the new inputs the run found to fuzz/corpus (merged)
# A finding (crash, sanitizer report, an exception other than moelora::Error, a write the
# op's contract forbids) stops the run: the input is saved under the build dir as
# crash-*; rerun it with `build-fuzz/moelora_fuzz <file>`, fix the bug, and commit the
# input to fuzz/regressions.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)  # the corpus's absolute path: the fuzzer runs in the build dir, which may lie anywhere
SECONDS_TO_RUN=${1:-120}
BUILD_DIR=${MOELORA_FUZZ_BUILD_DIR:-build-fuzz}
JOBS=${MOELORA_JOBS:-$(nproc)}
CXX_BIN=${MOELORA_FUZZ_CXX:-clang++}
if ! command -v "$CXX_BIN" >/dev/null 2>&1; then
  echo "fuzz: $CXX_BIN not found (tools/install_deps.sh installs clang)" >&2
  exit 1
fi
GENERATOR=()
command -v ninja >/dev/null 2>&1 && GENERATOR=(-G Ninja)
# NOTE: -fno-sanitize-recover makes every UBSan report fatal, so the fuzzer stops on it.
FLAGS="-g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all -fsanitize=fuzzer-no-link"
echo "=== fuzz: configuring $BUILD_DIR ($CXX_BIN, ASan + UBSan)"
mkdir -p "$BUILD_DIR"
cmake -S . -B "$BUILD_DIR" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER="$CXX_BIN" \
  -DCMAKE_CXX_FLAGS="$FLAGS" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DMOELORA_CUDA=OFF -DMOELORA_BUILD_TESTS=OFF -DMOELORA_BUILD_BENCHMARKS=OFF -DMOELORA_BUILD_PYTHON=OFF \
  -DMOELORA_BUILD_FUZZ=ON >"$BUILD_DIR/configure.log" 2>&1 || { cat "$BUILD_DIR/configure.log"; exit 1; }
echo "=== fuzz: building moelora_fuzz"
cmake --build "$BUILD_DIR" -j "$JOBS" --target moelora_fuzz 2>&1 | tail -n 3
FUZZER="$BUILD_DIR/moelora_fuzz"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

echo "=== fuzz: replaying fuzz/regressions and fuzz/corpus"
replay=()
for dir in fuzz/regressions fuzz/corpus; do
  [ -d "$dir" ] && [ -n "$(ls -A "$dir")" ] && replay+=("$dir"/*)
done
if [ ${#replay[@]} -gt 0 ]; then
  "$FUZZER" -runs=0 "${replay[@]}" >"$BUILD_DIR/replay.log" 2>&1 || { tail -n 40 "$BUILD_DIR/replay.log"; exit 1; }
  echo "replayed ${#replay[@]} inputs: ok"
fi
[ "$SECONDS_TO_RUN" = 0 ] && exit 0

echo "=== fuzz: $SECONDS_TO_RUN s on $JOBS workers"
NEW="$BUILD_DIR/new-corpus"
mkdir -p "$NEW"
status=0
# -fork: each worker a child process, so one finding stops the run with its input kept.
(cd "$BUILD_DIR" && "./moelora_fuzz" -fork="$JOBS" -max_total_time="$SECONDS_TO_RUN" -max_len=512 \
   -timeout=20 -rss_limit_mb=4096 "new-corpus" "$ROOT/fuzz/corpus") >"$BUILD_DIR/fuzz.log" 2>&1 || status=$?
grep -E "^#[0-9]+.*(DONE|INITED|pulse)|cov:" "$BUILD_DIR/fuzz.log" | tail -n 2 || true
if [ "$status" != 0 ] || ls "$BUILD_DIR"/crash-* "$BUILD_DIR"/timeout-* "$BUILD_DIR"/oom-* >/dev/null 2>&1; then
  # A failure without a finding (the fuzzer refused its arguments) shows the log's end.
  grep -B2 -A30 -E "ERROR|runtime error|invariant violated|deadly signal" "$BUILD_DIR/fuzz.log" | head -n 60 ||
    tail -n 20 "$BUILD_DIR/fuzz.log"
  echo "fuzz: FAILED (fuzzer exit $status; inputs: $(ls "$BUILD_DIR"/crash-* "$BUILD_DIR"/timeout-* "$BUILD_DIR"/oom-* 2>/dev/null | tr '\n' ' '))" >&2
  exit 1
fi
if [ "${MOELORA_FUZZ_KEEP:-0}" = 1 ]; then
  "$FUZZER" -merge=1 fuzz/corpus "$NEW" >"$BUILD_DIR/merge.log" 2>&1
  echo "fuzz/corpus: $(ls fuzz/corpus | wc -l) inputs after the merge"
fi
echo "fuzz: passed ($SECONDS_TO_RUN s, no finding)"
