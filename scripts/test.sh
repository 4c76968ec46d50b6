#!/usr/bin/env bash
# Builds zeroalloc and runs every test that needs no GPU: the suites on the simulated
# device, then the same suites under AddressSanitizer + UndefinedBehaviorSanitizer and
# under ThreadSanitizer. Exits non-zero when any test fails. On the GPU machine,
# scripts/gpu-check.sh runs the `gpu` label and the benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
jobs=${JOBS:-2}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-}

run_suite() {  # build-dir extra-cmake-args...
  local dir=$1; shift
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DZEROALLOC_BUILD_BENCH=OFF "$@" >/dev/null
  ninja -C "$dir" -j"$jobs"
  (cd "$dir" && ctest -LE gpu --output-on-failure -j1)
}

echo "== tests on the simulated device (Release, as scripts/demo.sh builds)"
run_suite build -DCMAKE_BUILD_TYPE=Release
echo "== the Python package (tests needing PyTorch and a GPU skip themselves here)"
python3 -m pytest --version >/dev/null 2>&1 || python3 -m pip install -q pytest 2>/dev/null \
  || apt-get install -y -qq python3-pytest
ZEROALLOC_DEVICE=sim python3 -m pytest -q tests/python
echo "== the same under AddressSanitizer + UndefinedBehaviorSanitizer"
ASAN_OPTIONS=detect_leaks=1 run_suite build-asan -DZEROALLOC_SANITIZE=address,undefined -DZEROALLOC_BUILD_DEMO=OFF
echo "== the same under ThreadSanitizer"
TSAN_OPTIONS=halt_on_error=1 run_suite build-tsan -DZEROALLOC_SANITIZE=thread -DZEROALLOC_BUILD_DEMO=OFF
echo "all tests passed"
