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

run_suite() {  # build-dir extra-cmake-args... (TEST_JOBS: the suites run at once, default 1)
  local dir=$1; shift
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DZEROALLOC_BUILD_BENCH=OFF "$@" >/dev/null
  ninja -C "$dir" -j"$jobs"
  (cd "$dir" && ctest -LE gpu --output-on-failure -j"${TEST_JOBS:-1}")
}

echo "== tests on the simulated device (Release, as scripts/demo.sh builds)"
run_suite build -DCMAKE_BUILD_TYPE=Release
echo "== the wheel: built by pip, installed into a fresh environment, used with no variable set"
tests/package/wheel_test.sh
echo "== the Python package (tests needing PyTorch and a GPU skip themselves here)"
python3 -m pytest --version >/dev/null 2>&1 || python3 -m pip install -q pytest 2>/dev/null \
  || apt-get install -y -qq python3-pytest
py=python3
# PyTorch on the CPU runs the module hooks' hint-sequence tests and the windowed step's
# bookkeeping tests (tests/python/test_hint_sequence.py, test_windowed_step_logic.py), and
# MkDocs builds the documentation site (tests/python/test_docs.py), in a virtual environment
# of its own. A failed install stops the run: those tests would skip
# and hide what they check. TEST_WITHOUT_TORCH=1 runs without them, and says so.
venv=build/torch-venv
if [[ ${TEST_WITHOUT_TORCH:-0} == 1 ]]; then
  echo "TEST_WITHOUT_TORCH=1: the tests that need PyTorch skip"
elif ! python3 -c "import torch" 2>/dev/null; then
  if ! "$venv/bin/python" -c "import torch, pytest, mkdocs, material" 2>/dev/null; then
    echo "installing PyTorch (CPU use) and MkDocs (the documentation site) into $venv"
    if ! { python3 -m venv "$venv" && "$venv/bin/pip" install -q torch pytest mkdocs-material; }; then
      echo "PyTorch could not be installed into $venv (see pip's message above); fix the" \
           "network or the index, or set TEST_WITHOUT_TORCH=1 to run without its tests" >&2
      exit 1
    fi
  fi
  py=$venv/bin/python
fi
ZEROALLOC_DEVICE=sim "$py" -m pytest -q -rs tests/python
echo "== the same under AddressSanitizer + UndefinedBehaviorSanitizer"
ASAN_OPTIONS=detect_leaks=1 run_suite build-asan -DZEROALLOC_SANITIZE=address,undefined -DZEROALLOC_BUILD_DEMO=OFF
echo "== the same under ThreadSanitizer"
# Two suites at once: under TSan they spend much of their time waiting (16 minutes one by
# one, 10 two at a time, on two cores).
TEST_JOBS=$jobs TSAN_OPTIONS=halt_on_error=1 run_suite build-tsan -DZEROALLOC_SANITIZE=thread -DZEROALLOC_BUILD_DEMO=OFF
echo "all tests passed"
