"""Training through zeroalloc computes exactly what training through PyTorch's allocator does.

Each allocator runs train_small_transformer.py in its own process (the swap is one-shot
per process); the 50 losses must agree bit for bit, and zeroalloc's own statistics must
show that it served the memory.

    python3 -m pytest -s tests/python/test_training_bitexact.py
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("train_small_transformer.py")
STEPS = 50
RUN_TIMEOUT_S = 600


def library_path() -> Path:
    return Path(os.environ.get("ZEROALLOC_LIBRARY")
                or REPO_ROOT / "build" / "libzeroalloc.so").resolve()


@pytest.fixture(scope="module")
def library() -> Path:
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False")
    path = library_path()
    if not path.is_file():
        pytest.skip(f"{path} does not exist: build the library first")
    return path


def train(allocator: str, library: Path) -> subprocess.CompletedProcess:
    environment = dict(os.environ)
    # The library may reject ZEROALLOC_* names it does not know; the path goes by argument.
    environment.pop("ZEROALLOC_LIBRARY", None)
    environment["ZEROALLOC_DEVICE"] = "cuda"  # whatever the calling environment says
    command = [sys.executable, str(SCRIPT), "--allocator", allocator,
               "--steps", str(STEPS), "--library", str(library)]
    result = subprocess.run(command, cwd=REPO_ROOT, env=environment, capture_output=True,
                            text=True, timeout=RUN_TIMEOUT_S)
    print(f"--- {allocator}: exit {result.returncode}")
    for line in result.stdout.splitlines():
        if line.startswith(("summary ", "stats ")):
            print(line)
    assert result.returncode == 0, (
        f"{allocator} run failed (exit {result.returncode}):\n"
        f"stdout tail:\n{result.stdout[-3000:]}\nstderr tail:\n{result.stderr[-6000:]}")
    return result


def losses(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("loss ")]


def stats_of(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("stats ")]
    assert len(lines) == 1, f"expected one 'stats ' line, got {len(lines)}"
    return json.loads(lines[0][len("stats "):])


def test_losses_are_bit_identical_and_zeroalloc_served_the_memory(library):
    native = train("native", library)
    zeroalloc = train("zeroalloc", library)

    native_losses = losses(native.stdout)
    zeroalloc_losses = losses(zeroalloc.stdout)
    assert len(native_losses) == STEPS, f"native printed {len(native_losses)} losses"
    assert len(zeroalloc_losses) == STEPS, f"zeroalloc printed {len(zeroalloc_losses)} losses"
    for native_line, zeroalloc_line in zip(native_losses, zeroalloc_losses):
        if native_line != zeroalloc_line:
            step, native_hex = native_line.split()[1:]
            zeroalloc_hex = zeroalloc_line.split()[2]
            pytest.fail(f"losses diverge at step {step}: native {float.fromhex(native_hex)!r}"
                        f" ({native_hex}), zeroalloc {float.fromhex(zeroalloc_hex)!r}"
                        f" ({zeroalloc_hex})")
    print(f"{STEPS} losses identical; first {native_losses[0].split()[2]}, "
          f"last {native_losses[-1].split()[2]}")

    stats = stats_of(zeroalloc.stdout)
    print("zeroalloc stats:\n" + json.dumps(stats, indent=2, sort_keys=True))
    total = stats["total"]
    print(f"allocations: {total['allocations']}; peak allocated: "
          f"{total['allocated_bytes']['peak']}; simulated: {stats['simulated']}")
    assert not stats["simulated"], "zeroalloc ran on the simulated device, not the GPU"
    assert total["allocations"] > 0, "zeroalloc served no allocation"
    assert total["allocated_bytes"]["peak"] > 0, "zeroalloc's peak allocated is 0"
