"""What the GPU training tests share: the library they use, skipping where there is no GPU or
no library, and a training script run in a fresh process (the library reads its variables
once) with the lines it prints read back by name."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"
LIBRARY = Path(os.environ.get("ZEROALLOC_LIBRARY", ROOT / "build" / "libzeroalloc.so")).resolve()


def require_gpu():
    """PyTorch with a CUDA GPU and the built library, else the calling module is skipped;
    returns torch."""
    torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("skipped: no CUDA GPU", allow_module_level=True)
    if not LIBRARY.is_file():
        pytest.skip(f"skipped: {LIBRARY} is not built", allow_module_level=True)
    return torch


def run_script(code: str, *arguments: str, **settings: str) -> str:
    """Runs `code` on CUDA through the library with `settings` (ZEROALLOC_* variables; none
    of the caller's) and 16 MiB chunks; returns its output, asserting that it succeeded."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ZEROALLOC_")}
    env.update({"ZEROALLOC_DEVICE": "cuda", "ZEROALLOC_LIBRARY": str(LIBRARY),
                "PYTHONPATH": str(PACKAGE), "ZEROALLOC_CHUNK_SIZE": "16MiB", **settings})
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *arguments], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result.stdout


def field(out: str, name: str) -> str:
    """The rest of the first line of `out` that starts with `name` and a space."""
    return next(line for line in out.splitlines() if line.startswith(name + " "))[len(name) + 1:]
