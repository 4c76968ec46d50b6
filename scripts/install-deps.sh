#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages zeroalloc builds and tests with. Idempotent; run as root.
# The CUDA Toolkit 13 (with NCCL) is expected at /usr/local/cuda (NVIDIA's packages).
set -euo pipefail
packages=(cmake ninja-build g++ pkg-config ccache libspdlog-dev libfmt-dev nlohmann-json3-dev libnuma-dev liburing-dev
          libgtest-dev libbenchmark-dev python3 python3-setuptools python3-venv)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
export DEBIAN_FRONTEND=noninteractive
updated=0
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq && updated=1
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# Headless Chromium checks the report page (tests/python/test_report.py). Optional: on
# Ubuntu the package needs snapd, and without it that one test says "skipped".
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  [ "$updated" = 1 ] || apt-get update -qq || true
  apt-get install -y -qq chromium >/dev/null 2>&1 \
    || echo "install-deps: chromium could not be installed; the report page test will be skipped" >&2
fi
if [ ! -f /usr/local/cuda/include/cuda.h ] && ! command -v nvcc >/dev/null; then
  echo "install-deps: the CUDA Toolkit 13 is not at /usr/local/cuda; install it from NVIDIA's" \
       "repository (cuda-toolkit-13-0) and NCCL (libnccl-dev)" >&2
  exit 1
fi
