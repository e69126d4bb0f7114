#!/usr/bin/env bash
# Installs what building and testing moelora needs, from the package registries, at
# pinned versions: the Python tools (requirements-dev.txt), torch for the torch ops' tests
# (requirements-torch.txt; MOELORA_TORCH=0 skips it), GoogleTest (Debian package, when
# missing), clang for the fuzz target (when missing) and, when nvcc is present, the
# CUTLASS headers into .deps/cutlass.
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."
CUTLASS_VERSION=4.2.0.0
PYTHON=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore

"$PYTHON" -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt

# torch is a multi-GB download: only when a pinned version is missing, and without a copy
# in pip's cache.
if [ "${MOELORA_TORCH:-1}" != 0 ] && ! "$PYTHON" - requirements-torch.txt <<'PY'
import sys
from importlib import metadata
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, version = line.split("==")
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            sys.exit(1)
PY
then
  echo "install_deps: installing $(grep -E '^[A-Za-z]' requirements-torch.txt | paste -sd' ') from PyPI" \
       "(with its CUDA runtime wheels: ~2.6 GB, a minute or more)"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-cache-dir -r requirements-torch.txt
fi

if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then
  echo "install_deps: GoogleTest headers missing; installing libgtest-dev"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libgtest-dev
fi

# The fuzz target (tools/fuzz.sh): clang with libFuzzer and the sanitizers' runtimes
# (Debian's clang package; MOELORA_FUZZ=0 skips it).
if [ "${MOELORA_FUZZ:-1}" != 0 ] && ! { command -v clang++ >/dev/null 2>&1 &&
    echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
    clang++ -x c++ -fsanitize=fuzzer,address,undefined - -o /tmp/moelora_fuzz_probe 2>/dev/null; }; then
  echo "install_deps: clang with libFuzzer missing; installing clang"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq clang
fi

if command -v nvcc >/dev/null 2>&1 || [ "${MOELORA_FETCH_CUTLASS:-0}" = 1 ]; then
  if [ ! -f .deps/cutlass/include/cute/tensor.hpp ] || [ "$(cat .deps/cutlass/VERSION 2>/dev/null)" != "$CUTLASS_VERSION" ]; then
    echo "install_deps: fetching CUTLASS $CUTLASS_VERSION headers"
    rm -rf .deps/cutlass .deps/wheels
    mkdir -p .deps/wheels .deps/cutlass
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      -d .deps/wheels "nvidia-cutlass==$CUTLASS_VERSION"
    "$PYTHON" - <<'PY'
import glob, zipfile, os
wheel = glob.glob(".deps/wheels/nvidia_cutlass-*.whl")[0]
prefix = "cutlass_library/source/include/"
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            dest = os.path.join(".deps/cutlass/include", name[len(prefix):])
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(name) as src, open(dest, "wb") as out:
                out.write(src.read())
PY
    echo "$CUTLASS_VERSION" > .deps/cutlass/VERSION
    rm -rf .deps/wheels
  fi
fi
# For GPU machines with no registry: a copy of GoogleTest's sources to carry along.
if [ "${MOELORA_STAGE_GTEST:-0}" = 1 ] && [ -d /usr/src/googletest ] && [ ! -d .deps/googletest ]; then
  mkdir -p .deps && cp -r /usr/src/googletest .deps/googletest
fi
echo "install_deps: done"
