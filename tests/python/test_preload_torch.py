"""An unmodified training script under LD_PRELOAD=libzeroalloc.so: PyTorch's own caching
allocator stays on top and takes its segments from zeroalloc (through cudaMalloc), with
expandable segments off; with them on, PyTorch maps memory itself through the driver's VMM
calls, which zeroalloc passes through. Either way the losses equal a run without zeroalloc,
bit for bit."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "python" / "train_small_transformer.py"
LIBRARY = Path(os.environ.get("ZEROALLOC_LIBRARY", ROOT / "build" / "libzeroalloc.so"))
STEPS = 20

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
if not torch.cuda.is_available():
    pytest.skip("skipped: no CUDA GPU", allow_module_level=True)
if not LIBRARY.is_file():
    pytest.skip(f"skipped: {LIBRARY} is not built", allow_module_level=True)


def train(preload: bool, expandable: bool, site_dir: Path | None = None,
          **environment) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("ZEROALLOC_")}
    env["ZEROALLOC_DEVICE"] = "cuda"  # whatever the calling environment says
    env["PYTORCH_CUDA_ALLOC_CONF"] = f"expandable_segments:{expandable}"
    env.update(environment)
    if preload:
        env["LD_PRELOAD"] = str(LIBRARY)
    arguments = [str(SCRIPT), "--allocator", "native", "--steps", str(STEPS)]
    command = [sys.executable, *arguments]
    if site_dir is not None:  # as if the package were installed: its .pth runs at start-up
        command = [sys.executable, "-c",
                   "import runpy, site, sys; site.addsitedir(sys.argv[1]); "
                   "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')",
                   str(site_dir), *arguments]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def losses(result):
    return [line for line in result.stdout.splitlines() if line.startswith("loss ")]


@pytest.mark.parametrize("expandable", [False, True], ids=["expandable-off", "expandable-on"])
def test_unmodified_script_trains_identically_under_preload(expandable, tmp_path):
    plain = train(preload=False, expandable=expandable)
    preloaded = train(preload=True, expandable=expandable,
                      ZEROALLOC_REPORT=str(tmp_path / "run"))
    report = json.loads((tmp_path / "run.json").read_text())  # written at exit
    assert report["reason"] == "exit" and (tmp_path / "run.html").is_file()
    assert report["devices"][0]["stats"]["total"]["allocations"] >= \
        json.loads([line for line in preloaded.stdout.splitlines()
                    if line.startswith("stats ")][0][len("stats "):])["total"]["allocations"]
    assert len(losses(plain)) == STEPS
    assert losses(preloaded) == losses(plain)
    stats_lines = [line for line in preloaded.stdout.splitlines() if line.startswith("stats ")]
    assert stats_lines, "the preloaded library was not found in the process"
    stats = json.loads(stats_lines[0][len("stats "):])
    total = stats["total"]
    created = stats["passthrough"]["cuMemCreate"]
    print(f"expandable_segments={expandable}: zeroalloc served {total['allocations']} "
          f"allocations, peak {total['allocated_bytes']['peak']} bytes")
    print(f"  cuMemCreate passed through: {created['calls']} calls, {created['bytes']} bytes")
    if not expandable:
        assert total["allocations"] > 0, "PyTorch's segments did not come from zeroalloc"
        assert total["allocated_bytes"]["peak"] > 100 << 20
        assert created["calls"] == 0, "zeroalloc's own VMM calls must not count as passed through"
    else:
        # PyTorch maps its expandable segments itself, through the driver's VMM calls: they
        # reach the driver unchanged and the statistics count them.
        assert created["calls"] > 0 and created["bytes"] >= 20 << 20


def test_environment_alone_makes_zeroalloc_pytorchs_allocator(tmp_path):
    """ZEROALLOC_TORCH=zeroalloc with the package installed (its start-up hook in
    site-packages) and the library preloaded: the unmodified script's tensors come straight
    from zeroalloc, with the same losses."""
    shutil.copy(ROOT / "bindings" / "python" / "zeroalloc-startup.pth", tmp_path)
    shutil.copytree(ROOT / "bindings" / "python" / "zeroalloc", tmp_path / "zeroalloc",
                    ignore=shutil.ignore_patterns("__pycache__"))
    plain = train(preload=False, expandable=False)
    swapped = train(preload=True, expandable=False, site_dir=tmp_path, ZEROALLOC_TORCH="zeroalloc")
    assert losses(swapped) == losses(plain)
    stats_lines = [line for line in swapped.stdout.splitlines() if line.startswith("stats ")]
    total = json.loads(stats_lines[0][len("stats "):])["total"]
    print(f"ZEROALLOC_TORCH=zeroalloc: {total['allocations']} allocations served directly")
    # PyTorch's caching allocator would have asked for a few large segments; zeroalloc
    # serving every tensor sees thousands of allocations.
    assert total["allocations"] > 20 * STEPS
