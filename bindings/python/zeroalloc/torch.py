"""zeroalloc for PyTorch.

``install()`` makes zeroalloc PyTorch's CUDA allocator for the whole process (two lines in a
script); ``mem_pool()`` routes only the allocations made inside ``torch.cuda.use_mem_pool``
through zeroalloc and leaves PyTorch's own allocator, statistics and cudnn for the rest.
"""

from __future__ import annotations

import torch

from zeroalloc._library import ZeroallocError, function_address, library_path

_allocator = None


def _pluggable_allocator():
    """One CUDAPluggableAllocator over libzeroalloc.so with all four hooks set."""
    global _allocator
    if _allocator is None:
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            str(library_path()), "zeroalloc_malloc", "zeroalloc_free")
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
    Afterwards torch.cuda.memory_stats and memory_snapshot are unavailable (PyTorch's own
    allocator is gone): use zeroalloc.memory_stats() and zeroalloc.memory_summary().
    """
    if torch.cuda.is_initialized():
        raise ZeroallocError(
            "zeroalloc.torch.install() must run before any CUDA work, and CUDA is already "
            "initialised in this process (by torch.cuda.set_device, a tensor on a GPU, ...). "
            "Call it at the top of the script, or use zeroalloc.torch.mem_pool() to route "
            "chosen tensors instead.")
    torch.cuda.memory.change_current_allocator(_pluggable_allocator())


def mem_pool() -> "torch.cuda.MemPool":
    """A torch.cuda.MemPool whose segments come from zeroalloc:
    ``with torch.cuda.use_mem_pool(zt.mem_pool()): ...``"""
    return torch.cuda.MemPool(_pluggable_allocator().allocator())
