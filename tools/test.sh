#!/usr/bin/env bash
# The test command: installs dependencies, builds everything, runs the C++ tests
# (ctest) and the Python tests (pytest). CUDA tests skip cleanly without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${MOELORA_SKIP_INSTALL:-0}" = 1 ] || bash tools/install_deps.sh
bash tools/build.sh
BUILD_DIR=${MOELORA_BUILD_DIR:-build}
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "${MOELORA_JOBS:-$(nproc)}"
MOELORA_EXT_DIR="$PWD/$BUILD_DIR" PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" \
  "${PYTHON:-python3}" -m pytest tests/python -q -rs
