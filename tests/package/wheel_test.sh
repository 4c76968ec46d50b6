#!/usr/bin/env bash
# The wheel as a user gets it: built from the source tree by pip (scikit-build-core runs
# CMake), installed into a fresh virtual environment and used from outside the repository
# with no ZEROALLOC_LIBRARY: the package finds the library inside itself, the library needs
# nothing but glibc, the start-up hook and the `zeroalloc` command are installed, and a
# preloaded copy serves a program. Exits non-zero, naming the check, when one fails.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-$root/build/wheel-test}
fail() { echo "wheel_test: $*" >&2; exit 1; }

rm -rf "$work" && mkdir -p "$work"
python3 -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" "$root" \
  || fail "pip could not build the wheel (its output is above)"
wheel=$(ls "$work"/dist/zeroalloc-*.whl)
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet --no-index --no-deps "$wheel"
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
allocations=$(LD_PRELOAD=$library "$python" -c '
import zeroalloc
lib = zeroalloc.library()
pointer = lib.zeroalloc_malloc(1 << 20, 0, None)
lib.zeroalloc_free(pointer, 1 << 20, 0, None)
print(zeroalloc.memory_stats()["allocation.all.allocated"])') \
  || fail "a program preloading the installed library failed"
[[ $allocations == 1 ]] || fail "the preloaded library served $allocations allocations, not 1"
echo "wheel_test: $(basename "$wheel") installs and works ($library; needs: $needed)"
