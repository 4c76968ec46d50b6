#!/usr/bin/env bash
# Builds zeroalloc and runs the demo. First a transformer's training allocation trace,
# replayed through the allocator, then again under a limit its optimizer states do not fit,
# with offload to host memory. Then, on a machine with a GPU, a Llama-style model trained
# through PyTorch under such a limit (demo/train_offload.py). Prints the report of the last
# run. Uses the GPU when one is present, else the simulated device.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DZEROALLOC_BUILD_TESTS=OFF -DZEROALLOC_BUILD_BENCH=OFF >/dev/null
ninja -C build -j"${JOBS:-2}" zeroalloc-demo
# Not ZEROALLOC_-prefixed: the library refuses variables of its prefix it does not know.
reports=${DEMO_REPORTS:-$PWD/build/demo-report}
mkdir -p "$reports"
report=$reports/zeroalloc
status=0
ZEROALLOC_REPORT=$report build/demo/zeroalloc-demo --offload "$@" || status=$?

# On a GPU: train a model through offload with PyTorch, installed if missing.
if nvidia-smi -L >/dev/null 2>&1; then
  if ! python3 -c "import torch" 2>/dev/null; then
    echo "== installing PyTorch for the training demo"
    python3 -m pip install --quiet torch 2>/dev/null || python3 -m pip install --quiet --break-system-packages torch
  fi
  if python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo
    echo "== training a Llama-style model through offload (demo/train_offload.py)"
    report=$reports/train
    python3 demo/train_offload.py --library build/libzeroalloc.so --report "$report" || status=$?
  else
    echo "PyTorch sees no GPU here: the training demo is skipped"
  fi
fi

if [[ -f $report.json ]] && command -v python3 >/dev/null; then
  echo
  echo "== the report ($report.json; open $report.html in a browser)"
  PYTHONPATH=$PWD/bindings/python ZEROALLOC_LIBRARY=$PWD/build/libzeroalloc.so \
    python3 -m zeroalloc report "$report.json" || true
fi
exit $status
