"""The allocator swap: zeroalloc as PyTorch's CUDA allocator, for the whole process
(install) or for the allocations made inside one memory pool (mem_pool)."""

from __future__ import annotations

import torch

from zeroalloc._library import ZeroallocError, function_address, library_path

_allocator = None
_installed = False  # whether install() made zeroalloc PyTorch's allocator in this process


def pluggable_allocator():
    """One CUDAPluggableAllocator over libzeroalloc.so with all four hooks set."""
    global _allocator
    if _allocator is None:
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            str(library_path()), "zeroalloc_torch_malloc", "zeroalloc_free")
        hooks = allocator.allocator()
        hooks.set_init_fn(function_address("zeroalloc_init"))
        hooks.set_reset_fn(function_address("zeroalloc_empty_cache"))
        hooks.set_memory_fraction_fn(function_address("zeroalloc_set_memory_fraction"))
        hooks.set_record_stream_fn(function_address("zeroalloc_record_stream"))
        _allocator = allocator
    return _allocator


def install() -> None:
    """Switches PyTorch to zeroalloc for every CUDA allocation of this process.

    Must run before any CUDA work (PyTorch allows the swap only then, once per process).
    From then on each optimizer step marks a step boundary for reports (one per step of
    each optimizer; those under zt.offload mark their own).
    Afterwards torch.cuda.memory_stats and memory_snapshot are unavailable (PyTorch's own
    allocator is gone): use zeroalloc.memory_stats() and zeroalloc.memory_summary().
    """
    global _installed
    if torch.cuda.is_initialized():
        raise ZeroallocError(
            "zeroalloc.torch.install() must run before any CUDA work, and CUDA is already "
            "initialised in this process (by torch.cuda.set_device, a tensor on a GPU, ...). "
            "Call it at the top of the script, or use zeroalloc.torch.mem_pool() to route "
            "chosen tensors instead.")
    torch.cuda.memory.change_current_allocator(pluggable_allocator())
    _installed = True
    from zeroalloc.torch import _step_marks
    _step_marks.mark_every_optimizer_step()  # reports show the run step by step


def installed() -> bool:
    """Whether install() has made zeroalloc PyTorch's allocator in this process."""
    return _installed


def mem_pool() -> "torch.cuda.MemPool":
    """A torch.cuda.MemPool whose segments come from zeroalloc:
    ``with torch.cuda.use_mem_pool(zt.mem_pool()): ...``"""
    return torch.cuda.MemPool(pluggable_allocator().allocator())
