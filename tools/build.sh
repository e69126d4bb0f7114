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
# NOTE: ptxas reports (C7510..C7515) when it serialises a kernel's wgmmas, e.g. because an
# ordinary instruction writes the accumulators inside a pipeline stage. Every sm90
# instance shipped that way unnoticed once (docs/PERF_NOTES.md, issue 3 step 4; no time
# lost then, the kernels waited on DRAM, but it caps the tensor rate). A fresh compile
# that prints it fails the build.
LOG="$BUILD_DIR/build.log"
mkdir -p "$BUILD_DIR"
cmake --build "$BUILD_DIR" -j "$JOBS" 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
[ "$status" = 0 ] || exit "$status"
if grep -q "wgmma.mma_async instructions are serialized" "$LOG"; then
  grep "wgmma.mma_async instructions are serialized" "$LOG" | head -3
  echo "error: ptxas serialised wgmma instructions (see above); fix the kernel before shipping it" >&2
  exit 1
fi
# Python: `import moelora` from anywhere without PYTHONPATH, as `pip install -e` would give: a
# .pth file naming this checkout's python/ folder (the package then finds its extension in
# build/, or in MOELORA_BUILD_DIR when set at import time). MOELORA_PTH=0 skips it.
if [ "${MOELORA_PTH:-1}" != 0 ]; then
  "$(command -v "${PYTHON:-python3}")" - "$PWD/python" <<'PY' || true
import os, site, sys, sysconfig
target = sys.argv[1]
for folder in (sysconfig.get_paths()["purelib"], site.getusersitepackages()):
    path = os.path.join(folder, "moelora-checkout.pth")
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as f:
            f.write(target + "\n")
    except OSError:
        continue
    print(f"python: `import moelora` finds this checkout ({path}; MOELORA_PTH=0 skips writing it)")
    break
PY
fi
