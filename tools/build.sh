#!/usr/bin/env bash
# Configures and builds moelora into ${MOELORA_BUILD_DIR:-build}: the library, the C++
# tests, the benchmark (main job) and the Python extension. The CUDA backend is built
# when nvcc is found (set MOELORA_CUDA=OFF to skip it). Extra arguments go to cmake.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${MOELORA_BUILD_DIR:-build}
JOBS=${MOELORA_JOBS:-$(nproc)}
GENERATOR=()
command -v ninja >/dev/null 2>&1 && GENERATOR=(-G Ninja)
cmake -S . -B "$BUILD_DIR" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DMOELORA_CUDA="${MOELORA_CUDA:-AUTO}" -DMOELORA_BUILD_PYTHON=ON \
  -DPython_EXECUTABLE="$(command -v "${PYTHON:-python3}")" "$@"
cmake --build "$BUILD_DIR" -j "$JOBS"
