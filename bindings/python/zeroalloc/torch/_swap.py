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
    compile_without_cuda_graphs()
    refuse_cuda_graph_capture()
    from zeroalloc.torch import _step_marks
    _step_marks.mark_every_optimizer_step()  # reports show the run step by step


# Note [Compiled without CUDA graphs]: PyTorch captures CUDA graphs only into its own
# allocator's private pools; with the allocator swapped, torch.compile's CUDA-graph trees
# (mode="reduce-overhead" or "max-autotune", or the option triton.cudagraphs) fail when
# they capture. Each such compile therefore runs without graphs: the same kernels, launched
# one by one, so the same results, without the launch savings. A warning says so, once.
_GRAPH_OPTIONS = ("triton.cudagraphs", "triton_cudagraphs")
_told_about_graphs = [False]


def compile_without_cuda_graphs() -> None:
    """Makes torch.compile leave out CUDA graphs in this process (Note [Compiled without
    CUDA graphs]). Once per process; a PyTorch without the hook is left as it is."""
    wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
    original = getattr(wrapper, "apply_options", None)
    if original is None or getattr(original, "_zeroalloc_without_graphs", False):
        return

    def apply_options(self, options):
        if options and any(options.get(key) for key in _GRAPH_OPTIONS):
            options = {key: value for key, value in options.items() if key not in _GRAPH_OPTIONS}
            if not _told_about_graphs[0]:
                _told_about_graphs[0] = True
                import warnings
                warnings.warn("zeroalloc: torch.compile's CUDA graphs need PyTorch's own "
                              "allocator, which zeroalloc replaced: this program's compiled "
                              "code runs without them (the same results, without the launch "
                              "savings). Use LD_PRELOAD alone to keep them.", stacklevel=2)
        return original(self, options)

    apply_options._zeroalloc_without_graphs = True
    wrapper.apply_options = apply_options


# Note [CUDA graphs under the swap]: PyTorch captures a CUDA graph only into a pool of its
# own allocator. CUDAGraph.capture_begin asks the current allocator to make the graph's pool
# (ensureExistsAndIncrefPool), which PyTorch's pluggable allocator does not implement, so the
# capture fails in PyTorch, after torch.cuda.graph has switched the current stream. Under
# the swap zeroalloc therefore refuses a capture before anything changed, in words that name
# the construct and the way out: LD_PRELOAD alone keeps PyTorch's allocator and its graphs.
# (Serving the graph pools needs that PyTorch hook first.) torch.compile's CUDA-graph modes
# never get here: they compile without graphs (Note [Compiled without CUDA graphs]).
CUDA_GRAPH_REFUSAL = (
    "zeroalloc: capturing a CUDA graph (torch.cuda.graph, CUDAGraph.capture_begin, "
    "torch.cuda.make_graphed_callables) needs PyTorch's own allocator, and zeroalloc "
    "replaced it in this process (zeroalloc.torch.install(), or ZEROALLOC_OFFLOAD=host "
    "with no code change). PyTorch captures graphs only into its own allocator's pools. To "
    "capture graphs, run the program with LD_PRELOAD=libzeroalloc.so alone, which keeps "
    "PyTorch's allocator, or without zeroalloc.")


def refuse_cuda_graph_capture() -> None:
    """Makes CUDA graph capture raise zeroalloc's refusal at once in this process (Note [CUDA
    graphs under the swap]). Once per process; a PyTorch without the classes is left as it
    is."""
    graphs = getattr(torch.cuda, "graphs", None)
    for owner, name in ((getattr(graphs, "graph", None), "__init__"),
                        (getattr(graphs, "CUDAGraph", None), "capture_begin")):
        original = getattr(owner, name, None) if owner is not None else None
        if original is None or getattr(original, "_zeroalloc_refuses", False):
            continue

        def refused(*args, **kwargs):
            raise ZeroallocError(CUDA_GRAPH_REFUSAL)

        refused._zeroalloc_refuses = True
        refused.__doc__ = original.__doc__
        setattr(owner, name, refused)


def installed() -> bool:
    """Whether install() has made zeroalloc PyTorch's allocator in this process."""
    return _installed


def mem_pool() -> "torch.cuda.MemPool":
    """A torch.cuda.MemPool whose segments come from zeroalloc:
    ``with torch.cuda.use_mem_pool(zt.mem_pool()): ...``"""
    return torch.cuda.MemPool(pluggable_allocator().allocator())
