#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages zeroalloc builds and tests with. Idempotent; run as root.
# The CUDA Toolkit 13 (with NCCL) is expected at /usr/local/cuda (NVIDIA's packages).
set -euo pipefail
packages=(cmake ninja-build g++ pkg-config ccache libspdlog-dev libfmt-dev libnuma-dev liburing-dev
          libgtest-dev libbenchmark-dev python3 chromium)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if [ ! -f /usr/local/cuda/include/cuda.h ] && ! command -v nvcc >/dev/null; then
  echo "install-deps: the CUDA Toolkit 13 is not at /usr/local/cuda; install it from NVIDIA's" \
       "repository (cuda-toolkit-13-0) and NCCL (libnccl-dev)" >&2
  exit 1
fi
