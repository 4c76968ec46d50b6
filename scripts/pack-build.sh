#!/usr/bin/env bash
# Packs this machine's build (build/, configured with ZEROALLOC_BUILD_TESTS=ON, and with
# the benchmarks where ZEROALLOC_BUILD_BENCH=ON built them) into
# .prebuilt/ for scripts/gpu-check.sh on a GPU machine of the same CUDA major version
# (GPU_CHECK_PREBUILT=.prebuilt): its test binaries, libzeroalloc.so, the CTest files,
# the shared libraries they need that such a machine may lack, and the path it was built
# at. It saves the build's minutes there.
set -euo pipefail
cd "$(dirname "$0")/.."
pack=.prebuilt
rm -rf "$pack"
mkdir -p "$pack/build/tests" "$pack/build/lib" "$pack/build/demo" "$pack/lib"
cp build/libzeroalloc.so build/CTestTestfile.cmake "$pack/build/"
cp build/demo/CTestTestfile.cmake "$pack/build/demo/"
find build/tests -maxdepth 1 -type f \( -perm -u+x -o -name "*.cmake" \) \
  -exec cp {} "$pack/build/tests/" \;
# The benchmarks, where the build has them (ZEROALLOC_BUILD_BENCH=ON): the GPU check's
# bench steps run them from build/bench.
benches=()
if [[ -d build/bench ]]; then
  mkdir -p "$pack/build/bench"
  while IFS= read -r bench; do benches+=("$bench"); cp "$bench" "$pack/build/bench/"; done \
    < <(find build/bench -maxdepth 1 -type f -perm -u+x)
fi
for binary in build/libzeroalloc.so build/tests/*_test "${benches[@]}"; do ldd "$binary"; done |
  awk '$3 ~ /^\// {print $3}' | sort -u |
  grep -E "libspdlog|libfmt|liburing|libcudart|libnuma|libgtest|libbenchmark" |
  while read -r library; do cp -L "$library" "$pack/lib/"; done
echo "$PWD" >"$pack/source-dir"
git rev-parse --short HEAD >"$pack/commit"
if ! git diff --quiet HEAD; then echo "(with changes not committed)" >>"$pack/commit"; fi
du -sh "$pack"
