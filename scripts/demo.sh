#!/usr/bin/env bash
# Builds zeroalloc and runs the demo: a transformer's training allocation trace replayed
# through the allocator. Uses the GPU when one is present, else the simulated device.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DZEROALLOC_BUILD_TESTS=OFF -DZEROALLOC_BUILD_BENCH=OFF >/dev/null
ninja -C build -j"${JOBS:-2}" zeroalloc-demo
exec build/demo/zeroalloc-demo --offload "$@"
