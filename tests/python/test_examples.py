"""The scripts in examples/, run as docs/recipes.md tells a user to run them.

The ZeRO example runs here, on the CPU over gloo, with the simulated device behind it. The
offload examples need a CUDA GPU and skip without one (scripts/gpu-check.sh runs them).
examples/c_api runs in ctest (example_c_api_test).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
PACKAGE = ROOT / "bindings" / "python"
LIBRARY = Path(os.environ.get("ZEROALLOC_LIBRARY", ROOT / "build" / "libzeroalloc.so")).resolve()
torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
if not LIBRARY.exists():
    pytest.skip(f"skipped: {LIBRARY} is not built", allow_module_level=True)

sys.path.insert(0, str(ROOT / "tests" / "python"))
from test_group import installed_site, unmodified_under_torchrun  # noqa: E402


def clean_environment(**settings) -> dict:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("ZEROALLOC_") and "TORCHINDUCTOR_" not in key
           and key != "PYTHONPATH"}
    # One cuBLAS workspace size in both runs, so that both pick the same kernels.
    env.update({"ZEROALLOC_LIBRARY": str(LIBRARY), "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                **settings})
    return env

def test_the_zero_example_partitions_the_states_and_trains_the_same_model(tmp_path):
    site = installed_site(tmp_path)
    script = EXAMPLES / "zero_torchrun.py"
    lines = {}
    for stage in ("0", "2"):
        # The CPU over gloo on any machine: on a GPU machine, with GPUs hidden, as the
        # example would otherwise want one GPU per rank.
        run = unmodified_under_torchrun(tmp_path, site, script, ZEROALLOC_DEVICE="sim",
                                        ZEROALLOC_ZERO_STAGE=stage, CUDA_VISIBLE_DEVICES="")
        lines[stage] = sorted(re.findall(r"rank (\d): states for (\d) of 4 parameters, "
                                         r"checksum (-?[0-9.]+)", run.stdout))
        assert len(lines[stage]) == 2, run.stdout
    assert [int(states) for _, states, _ in lines["0"]] == [4, 4]
    assert sorted(int(states) for _, states, _ in lines["2"]) == [1, 3]  # each rank its share
    checksums = {checksum for stage in lines for _, _, checksum in lines[stage]}
    assert len(checksums) == 1, lines  # every rank, with and without the variable


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no CUDA GPU")
LIMIT = {"ZEROALLOC_OFFLOAD": "host", "ZEROALLOC_MEMORY_LIMIT": "1536MiB"}


@needs_gpu
def test_the_offload_example_trains_under_a_limit_below_its_footprint():
    run = subprocess.run([sys.executable, str(EXAMPLES / "train_offload.py")],
                         env={**clean_environment(**LIMIT), "PYTHONPATH": str(PACKAGE)},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(re.findall(r"^step \d: loss", run.stdout, re.M)) == 6, run.stdout
    moved = int(re.search(r"moved to the host: (\d+) MiB", run.stdout).group(1))
    assert moved > 0, run.stdout  # the limit made it offload


@needs_gpu
def test_the_unchanged_script_prints_the_same_under_offload_as_natively(tmp_path):
    site = installed_site(tmp_path)
    script = EXAMPLES / "no_code_change.py"

    def output(**settings):
        run = subprocess.run([sys.executable, str(tmp_path / "launch.py"), str(site),
                              str(script)], env=clean_environment(**settings),
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        return run.stdout

    native = output()
    assert len(native.splitlines()) == 7, native
    assert output(**LIMIT) == native
