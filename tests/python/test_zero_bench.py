"""bench/python/zero_bench.py on the CPU (gloo, the simulated device's group, a tiny Llama):
every mode it runs there trains, and alike: DistributedDataParallel and zeroalloc's three
stages end on the same loss, bit for bit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = Path(os.environ.get("ZEROALLOC_LIBRARY", ROOT / "build" / "libzeroalloc.so"))
if not LIBRARY.exists():
    pytest.skip(f"skipped: {LIBRARY} is not built", allow_module_level=True)
pytest.importorskip("torch.distributed.run", reason="skipped: PyTorch (torchrun) is not installed")
pytest.importorskip("transformers", reason="skipped: the bench's model needs transformers")

sys.path.insert(0, str(ROOT / "tests" / "python"))
from test_group import free_port  # noqa: E402


def test_the_zero_bench_trains_every_mode_alike_on_the_cpu():
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "python" / "zero_bench.py"), "--device", "cpu",
         "--nproc", "2", "--modes", "ddp,zero1,zero2,zero3", "--hidden", "64",
         "--intermediate", "128", "--layers", "2", "--heads", "4", "--vocab", "256",
         "--batch", "2", "--seq", "16", "--steps", "2", "--warmup", "1",
         "--library", str(LIBRARY), "--port", str(free_port())],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    results = report["results"]
    assert sorted(results) == ["ddp", "zero1", "zero2", "zero3"]
    losses = {mode: [r["loss"] for r in ranks] for mode, ranks in results.items()}
    assert all(len(each) == 2 for each in losses.values()), losses
    assert len({loss for each in losses.values() for loss in each[:1]}) == 1, losses
    for mode in ("zero1", "zero2", "zero3"):
        assert results[mode][0]["zero"]["stage"] == int(mode[-1]), results[mode][0]
