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


def numeric_leaves(tree, prefix: str = ""):
    """(dotted path, number) for every number in a JSON tree."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from numeric_leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from numeric_leaves(value, f"{prefix}.{index}")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield prefix, tree


# The stats format is the library's to choose; these patterns accept the usual spellings
# (allocations, alloc_count, num_allocs, allocation.all.allocated; peak_allocated_bytes,
# allocated_bytes.peak, ...), and a failure prints every key so they can be adjusted.
ALLOCATION_COUNT = (re.compile(r"alloc"),
                    re.compile(r"byte|size|peak|current|fail|retr|free|error|oom|reserv|limit"))
PEAK_ALLOCATED = (re.compile(r"peak.*(alloc|in_use|used)|(alloc|in_use|used).*peak"),
                  re.compile(r"reserv|cache|mapped|physical|segment|chunk|count|limit"))


def largest_match(stats: dict, pattern) -> tuple[str, float]:
    wanted, unwanted = pattern
    matches = [(path, value) for path, value in numeric_leaves(stats)
               if wanted.search(path.lower()) and not unwanted.search(path.lower())]
    assert matches, ("no statistic matches " + wanted.pattern + "; keys are: "
                     + ", ".join(path for path, _ in numeric_leaves(stats)))
    return max(matches, key=lambda match: match[1])


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
    count_key, count = largest_match(stats, ALLOCATION_COUNT)
    peak_key, peak = largest_match(stats, PEAK_ALLOCATED)
    print(f"allocations: {count_key} = {count}; peak allocated: {peak_key} = {peak}")
    assert count > 0, f"zeroalloc served no allocation ({count_key} = {count})"
    assert peak > 0, f"zeroalloc's peak allocated is {peak} ({peak_key})"
