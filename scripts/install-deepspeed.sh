#!/usr/bin/env bash
# Installs DeepSpeed, for the Llama bench's ds2 and ds3 modes, from the files in .whl/ds/
# (its sdist and its dependencies' wheels; no network) into a directory of its own, so that
# nothing of the Python it runs under changes: a dependency that Python imports already is
# left to it, a missing one is installed beside DeepSpeed. Running it again installs only
# what is missing. It ends with the line to export (PYTHONPATH, and PATH where ninja came
# from .whl/ds).
#
#   bash scripts/install-deepspeed.sh [TARGET]      TARGET: default /tmp/deepspeed-site
#
# PYTHON: the Python to install for (default python3; it must import torch, which
# DeepSpeed's setup.py reads). WHEELS: where the files are (default .whl/ds).
# DS_BUILD_OPS=0: no op is compiled here. DeepSpeed compiles CPU Adam where it is first used
# (torch.utils.cpp_extension, into ~/.cache/torch_extensions), which needs a C++ compiler,
# ninja and Python's headers, not nvcc.
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
target=${1:-/tmp/deepspeed-site}
wheels=${WHEELS:-.whl/ds}

die() { echo "install-deepspeed: $*" >&2; exit 1; }

command -v "$python" >/dev/null || die "no '$python' (set PYTHON to the Python to install for)"
"$python" -m pip --version >/dev/null 2>&1 || die "$python has no pip ($python -m pip)"
sdists=("$wheels"/deepspeed-*.tar.gz)
((${#sdists[@]} == 1)) \
  || die "want one deepspeed-*.tar.gz in $wheels, found ${#sdists[@]} (WHEELS: the folder)"
sdist=${sdists[0]}
version=$(basename "$sdist" .tar.gz); version=${version#deepspeed-}
mkdir -p "$target" || die "cannot create $target"
target=$(cd "$target" && pwd)

# Runs Python with the target first on its path, as the bench's workers will.
in_target() { PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" "$python" "$@"; }

print_exports() {
  echo "export PYTHONPATH=$target\${PYTHONPATH:+:\$PYTHONPATH}"
  if [[ -x $target/bin/ninja ]] && ! command -v ninja >/dev/null; then
    echo "export PATH=$target/bin:\$PATH"
  fi
}

"$python" -c "import torch" 2>/dev/null \
  || die "$python cannot import torch: DeepSpeed's setup.py needs it (set PYTHON)"

if in_target -c "import deepspeed, sys; sys.exit(deepspeed.__version__.split('+')[0] != '$version')" \
     >/dev/null 2>&1 && { command -v ninja >/dev/null || [[ -x $target/bin/ninja ]]; }; then
  echo "install-deepspeed: DeepSpeed $version is installed in $target already"
  print_exports
  exit 0
fi

# pip install --target skips PEP 668's check (the marker belongs to the system's
# site-packages, which --target does not write); should a pip refuse all the same, say
# that its environment is externally managed, again with --break-system-packages.
pip_install() {
  local output
  if output=$("$python" -m pip install --no-index --no-deps --no-cache-dir --upgrade \
                --target "$target" "$@" 2>&1); then
    return 0
  fi
  if grep -q "externally-managed-environment" <<<"$output"; then
    output=$("$python" -m pip install --no-index --no-deps --no-cache-dir --upgrade \
               --break-system-packages --target "$target" "$@" 2>&1) && return 0
  fi
  echo "$output" >&2
  die "pip could not install $* into $target (the wheels in $wheels are for CPython 3.12 on" \
      "x86-64; $python is $("$python" -c 'import platform; print(platform.python_version(), platform.machine())'))"
}

wheel_of() {  # the one wheel of a distribution in $wheels
  local found=("$wheels"/"$1"-[0-9]*.whl)
  ((${#found[@]} == 1)) || die "want one wheel of $1 in $wheels, found ${#found[@]}"
  echo "${found[0]}"
}

# module : distribution whose wheel provides it : the check that what is there will do
# (ninja comes last, below)
dependencies=(
  "hjson:hjson:import hjson"
  "cpuinfo:py_cpuinfo:import cpuinfo"
  "pydantic:pydantic:import pydantic, sys; sys.exit(int(pydantic.VERSION.split('.')[0]) < 2)"
  "msgpack:msgpack:import msgpack"
  "einops:einops:import einops"
  "psutil:psutil:import psutil"
  "tqdm:tqdm:import tqdm"
  "packaging:packaging:import packaging.version, sys; sys.exit(packaging.version.Version(__import__('packaging').__version__).major < 20)"
  "numpy:numpy:import numpy"
)
missing=()
for entry in "${dependencies[@]}"; do
  IFS=: read -r module distribution check <<<"$entry"
  if in_target -c "$check" >/dev/null 2>&1; then
    continue
  fi
  missing+=("$module")
  distributions=("$distribution")
  if [[ $module == pydantic ]]; then
    # pydantic 2 pins its pydantic_core exactly: both come from here, with what they need.
    distributions+=(pydantic_core annotated_types typing_inspection typing_extensions)
  fi
  files=()
  for name in "${distributions[@]}"; do
    file=$(wheel_of "$name")  # an assignment, so that a missing wheel stops the script
    files+=("$file")
  done
  pip_install "${files[@]}"
done
echo "install-deepspeed: dependencies installed into $target: ${missing[*]:-none}"

# setup.py imports torch, so the build must see this Python's packages: no isolation.
"$python" -c "import setuptools" 2>/dev/null \
  || die "$python cannot import setuptools, which builds DeepSpeed's sdist"
echo "install-deepspeed: building DeepSpeed $version (DS_BUILD_OPS=0: ops compile at first use)"
DS_BUILD_OPS=0 PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" \
  pip_install --no-build-isolation "$sdist"

in_target -c "import deepspeed; print('install-deepspeed: deepspeed', deepspeed.__version__, 'from', deepspeed.__file__)" \
  || die "DeepSpeed was installed into $target but does not import (output above)"

# torch.utils.cpp_extension runs the ninja program, found on PATH. Its wheel's program goes
# to TARGET/bin, which each later pip install --target --upgrade replaces whole (DeepSpeed's
# scripts land there too): so it is installed last, through a folder of its own.
if ! command -v ninja >/dev/null && [[ ! -x $target/bin/ninja ]]; then
  staging=$target/.ninja-wheel
  rm -rf "$staging"
  file=$(wheel_of ninja)
  "$python" -m pip install --no-index --no-deps --no-cache-dir --target "$staging" "$file" \
    >/dev/null || die "pip could not unpack $file"
  mkdir -p "$target/bin"
  cp "$staging/bin/ninja" "$target/bin/ninja" || die "no bin/ninja in $file"
  rm -rf "$staging"
  echo "install-deepspeed: ninja installed as $target/bin/ninja"
fi

# What CPU Adam's build at first use will need; the bench's worker says so again.
include=$("$python" -c "import sysconfig; print(sysconfig.get_path('include', scheme='posix_prefix'))")
[[ -f $include/Python.h ]] \
  || echo "install-deepspeed: warning: $include/Python.h is missing: CPU Adam will not compile" >&2
command -v "${CXX:-c++}" >/dev/null \
  || echo "install-deepspeed: warning: no C++ compiler (c++ or \$CXX): CPU Adam will not compile" >&2
print_exports
