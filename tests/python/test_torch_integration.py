"""zeroalloc.torch on a GPU: install() switches PyTorch to zeroalloc (and refuses once CUDA
is initialised), mem_pool() routes only chosen tensors. Each case runs in a fresh process,
because PyTorch allows the allocator swap once per process, before CUDA starts."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
if not torch.cuda.is_available():
    pytest.skip("skipped: no CUDA GPU", allow_module_level=True)


def run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(PACKAGE), "ZEROALLOC_DEVICE": "cuda"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_install_serves_every_cuda_allocation_from_zeroalloc():
    out = run("""
        import torch, zeroalloc, zeroalloc.torch as zt
        zt.install()
        x = torch.randn(4096, 4096, device="cuda")
        y = x @ x
        stats = zeroalloc.memory_stats()
        assert stats["zeroalloc.simulated"] is False
        assert stats["allocated_bytes.all.current"] >= 2 * 4096 * 4096 * 4, stats
        del x, y
        torch.cuda.empty_cache()  # reaches zeroalloc_empty_cache through the reset hook
        torch.cuda.set_per_process_memory_fraction(0.5)
        stats = zeroalloc.memory_stats()
        assert "set_per_process_memory_fraction(0.5)" in stats["zeroalloc.limit_source"], stats
        print(zeroalloc.memory_summary())
    """)
    assert "| total" in out


def test_install_after_cuda_started_says_what_to_do():
    out = run("""
        import torch, zeroalloc, zeroalloc.torch as zt
        torch.zeros(1, device="cuda")
        try:
            zt.install()
        except zeroalloc.ZeroallocError as failure:
            print(failure)
    """)
    assert "must run before any CUDA work" in out


def test_mem_pool_routes_only_the_tensors_inside_it():
    run("""
        import torch, zeroalloc, zeroalloc.torch as zt
        pool = zt.mem_pool()
        with torch.cuda.use_mem_pool(pool), zeroalloc.allocation_class("parameter"):
            weights = torch.ones(8 << 20, device="cuda")
        activations = torch.ones(8 << 20, device="cuda")  # PyTorch's own allocator
        stats = zeroalloc.memory_stats()
        assert stats["allocated_bytes.parameter.current"] >= 32 << 20, stats
        assert stats["allocated_bytes.other.current"] == 0, stats
        assert torch.cuda.memory_allocated() >= 32 << 20  # PyTorch's statistics still work
        assert float(weights.sum()) == float(8 << 20)
        del weights, activations
    """)


def test_snapshot_opens_in_pytorchs_memory_viz():
    out = run("""
        import torch, zeroalloc, zeroalloc.torch as zt
        from torch.cuda import _memory_viz
        zt.install()
        x = torch.randn(1 << 22, device="cuda")
        y = torch.randn(1 << 10, device="cuda")
        data = zeroalloc.snapshot()
        print(_memory_viz.segsum(data))  # asserts that every segment's bytes add up
        html = _memory_viz.segment_plot(data)
        assert "snapshot.pickle" in html
        print(_memory_viz.trace(data))
    """)
    assert "total_allocated" in out


def test_sharing_a_tensor_with_another_process_fails_clearly_and_native_tensors_still_share():
    # Known limit (README): zeroalloc's memory is VMM memory, which CUDA's legacy IPC does
    # not share. Through install(), PyTorch refuses with its own message; a tensor from
    # zt.mem_pool() fails in cudaIpcGetMemHandle; a tensor of PyTorch's allocator shares.
    # Each in its own process: a failed CUDA call must not decide the next case.
    cases = {
        "install": "zt.install()\nx = torch.ones(1 << 20, device='cuda')",
        "mem_pool": "with torch.cuda.use_mem_pool(zt.mem_pool()):\n"
                    "    x = torch.ones(1 << 20, device='cuda')",
        "native": "x = torch.ones(1 << 20, device='cuda')",
    }
    said = {}
    for name, setup in cases.items():
        said[name] = run("import torch, zeroalloc.torch as zt\n"
                         "from torch.multiprocessing.reductions import reduce_tensor\n"
                         + setup + "\n"
                         "try:\n"
                         "    reduce_tensor(x)\n"
                         "    print('shared')\n"
                         "except Exception as error:\n"
                         "    print('refused:', type(error).__name__, error)\n")
    assert "refused:" in said["install"] and "shareIPcHandle" in said["install"], said
    assert "refused:" in said["mem_pool"], said
    assert said["native"].strip() == "shared", said
