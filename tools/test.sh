#!/usr/bin/env bash
# The test command: installs dependencies, builds everything, runs the C++ tests
# (ctest), the Python tests (pytest) and the fuzz target (tools/fuzz.sh, bounded). CUDA
# tests skip cleanly without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${MOELORA_SKIP_INSTALL:-0}" = 1 ] || bash tools/install_deps.sh
bash tools/build.sh
BUILD_DIR=${MOELORA_BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${MOELORA_JOBS:-$(nproc)}"
# The fuzz target over every op (issue 33): the committed inputs, then a bounded run.
# MOELORA_FUZZ=0 skips it; MOELORA_FUZZ_SECONDS sets the run (default 120).
if [ "${MOELORA_FUZZ:-1}" != 0 ]; then
  bash tools/fuzz.sh "${MOELORA_FUZZ_SECONDS:-120}"
fi
MOELORA_EXT_DIR="$PWD/$BUILD_DIR" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" \
  "${PYTHON:-python3}" -m pytest tests/python -q -rs
