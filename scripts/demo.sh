#!/usr/bin/env bash
# Builds zeroalloc and runs the demo: a transformer's training allocation trace replayed
# through the allocator, then again under a limit its optimizer states do not fit, with
# offload to host memory; prints the run's report last. Uses the GPU when one is present,
# else the simulated device.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DZEROALLOC_BUILD_TESTS=OFF -DZEROALLOC_BUILD_BENCH=OFF >/dev/null
ninja -C build -j"${JOBS:-2}" zeroalloc-demo
# The run's report (ZEROALLOC_REPORT): JSON and a self-contained page, summarised last.
report=${ZEROALLOC_REPORT:-$PWD/build/demo-report/zeroalloc}
mkdir -p "$(dirname "$report")"
status=0
ZEROALLOC_REPORT=$report build/demo/zeroalloc-demo --offload "$@" || status=$?
if [[ -f $report.json ]] && command -v python3 >/dev/null; then
  echo
  echo "== the report ($report.json; open $report.html in a browser)"
  PYTHONPATH=$PWD/bindings/python ZEROALLOC_LIBRARY=$PWD/build/libzeroalloc.so \
    python3 -m zeroalloc report "$report.json" || true
fi
exit $status
