"""Note [Compiled without CUDA graphs] (zeroalloc/torch/_swap.py): with zeroalloc as
PyTorch's allocator, torch.compile's CUDA-graph modes compile without graphs (PyTorch
captures graphs only into its own allocator's pools), with one warning; other options stay.
Checked on the options torch.compile hands to Inductor, which needs no GPU."""

import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bindings" / "python"))
from zeroalloc.torch import _swap  # noqa: E402

wrapper = getattr(torch, "_TorchCompileInductorWrapper", None)
if wrapper is None:
    pytest.skip("skipped: this PyTorch has no _TorchCompileInductorWrapper",
                allow_module_level=True)


def inductor_options(mode=None, options=None) -> dict:
    return wrapper(mode, options, False).config


def test_after_the_swap_cuda_graph_modes_compile_without_graphs_and_say_so_once(monkeypatch):
    monkeypatch.setattr(wrapper, "apply_options", wrapper.apply_options)  # undone after
    monkeypatch.setattr(_swap, "_told_about_graphs", [False])
    assert inductor_options("reduce-overhead").get("triton.cudagraphs")  # PyTorch's own
    _swap.compile_without_cuda_graphs()
    _swap.compile_without_cuda_graphs()  # once per process: not wrapped twice
    with pytest.warns(UserWarning, match="CUDA graphs need PyTorch's own allocator"):
        assert not inductor_options("reduce-overhead").get("triton.cudagraphs")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        autotuned = inductor_options("max-autotune")
        assert autotuned.get("max_autotune") and not autotuned.get("triton.cudagraphs")
        explicit = inductor_options(None, {"triton.cudagraphs": True, "epilogue_fusion": False})
        assert "triton.cudagraphs" not in explicit and explicit["epilogue_fusion"] is False
        assert inductor_options("default") == {}


def test_after_the_swap_a_cuda_graph_capture_is_refused_at_once_saying_why(monkeypatch):
    # Note [CUDA graphs under the swap]: PyTorch would fail inside the capture, after
    # switching the stream; zeroalloc refuses before anything changed, naming the way out.
    from zeroalloc._library import ZeroallocError
    graphs = torch.cuda.graphs
    monkeypatch.setattr(graphs.graph, "__init__", graphs.graph.__init__)  # undone after
    monkeypatch.setattr(graphs.CUDAGraph, "capture_begin", graphs.CUDAGraph.capture_begin)
    _swap.refuse_cuda_graph_capture()
    refused = graphs.graph.__init__
    _swap.refuse_cuda_graph_capture()  # once per process: not wrapped twice
    assert graphs.graph.__init__ is refused
    with pytest.raises(ZeroallocError, match="LD_PRELOAD=libzeroalloc.so alone"):
        with torch.cuda.graph(object()):
            pytest.fail("the capture's body ran")
    with pytest.raises(ZeroallocError, match="CUDAGraph.capture_begin"):
        graphs.CUDAGraph.capture_begin(object())

