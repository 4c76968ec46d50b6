"""The start-up hook: ``zeroalloc-startup.pth`` (installed into site-packages with the
package) imports this module when Python starts in a process that preloads libzeroalloc.so
or sets ZEROALLOC_TORCH, so that environment variables alone switch an unmodified script:

    ZEROALLOC_TORCH=zeroalloc python train.py
    ZEROALLOC_OFFLOAD=host python train.py
    ZEROALLOC_ZERO_STAGE=1 torchrun --nproc-per-node 2 train.py
    LD_PRELOAD=libzeroalloc.so ZEROALLOC_REPORT=/tmp/run python train.py

Nothing happens until ``torch`` is imported; then what the environment asks for is done
before the script can touch CUDA. A failure here never stops Python from starting: it is
reported on standard error with what to do.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading

#: Values of ZEROALLOC_TORCH, as the library's options table accepts them.
TORCH_CHOICES = ("native", "zeroalloc")


def torch_allocator_choice() -> str:
    """ZEROALLOC_TORCH, checked: "native" (the default) or "zeroalloc"."""
    value = os.environ.get("ZEROALLOC_TORCH", "native").strip().lower()
    if value not in TORCH_CHOICES:
        from zeroalloc._library import ZeroallocError
        raise ZeroallocError(
            f"ZEROALLOC_TORCH={os.environ['ZEROALLOC_TORCH']!r} is not valid: use one of "
            f"{'|'.join(TORCH_CHOICES)} (native keeps PyTorch's allocator on top of zeroalloc; "
            "zeroalloc makes zeroalloc PyTorch's allocator)")
    return value


#: Values of ZEROALLOC_ZERO_STAGE the package acts on (0: none).
ZERO_STAGES = ("0", "1", "2", "3")


def zero_stage() -> int:
    """ZEROALLOC_ZERO_STAGE, checked: 0 (the default, no partitioning), 1, 2 or 3."""
    value = os.environ.get("ZEROALLOC_ZERO_STAGE", "0").strip()
    if value not in ZERO_STAGES:
        from zeroalloc._library import ZeroallocError
        raise ZeroallocError(
            f"ZEROALLOC_ZERO_STAGE={os.environ['ZEROALLOC_ZERO_STAGE']!r} is not valid: use "
            "1 (each rank steps its share of the parameters and holds only their optimizer "
            "states), 2 (and only their gradients), 3 (and only the parameters themselves "
            "between uses) or 0 (none)")
    return int(value)


def offload_requested() -> bool:
    return os.environ.get("ZEROALLOC_OFFLOAD", "none").strip().lower() == "host"


def on_torch_imported(torch_module) -> None:
    """Runs right after ``import torch`` has finished, before the script continues."""
    # Offload pages PyTorch's tensors, so it needs zeroalloc as PyTorch's allocator.
    if "ZEROALLOC_TORCH" in os.environ and torch_allocator_choice() == "native" and \
            offload_requested():
        import warnings
        warnings.warn("zeroalloc: ZEROALLOC_OFFLOAD=host makes zeroalloc PyTorch's allocator "
                      "(offload pages PyTorch's tensors); ZEROALLOC_TORCH=native is overridden")
    if torch_allocator_choice() == "zeroalloc" or offload_requested():
        import zeroalloc.torch as zt
        zt.install()
        if offload_requested():
            zt.enable_automatic_offload()
    if zero_stage():  # after offload: a partitioned step wraps the windowed one
        from zeroalloc.torch._zero import enable_automatic_partition
        enable_automatic_partition(zero_stage())


class _TorchImportWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``torch`` is looked up, it wraps the loader that the other
    finders chose so that on_torch_imported runs once torch's module has executed. Every
    lookup's spec is wrapped, and the watcher leaves only when torch executes: a lookup that
    imports nothing (transformers probes with importlib.util.find_spec) must not use it up."""

    def __init__(self):
        self._looking = threading.local()  # its own lookup below, per thread
        self._done = False

    def find_spec(self, name, path=None, target=None):
        if name != "torch" or self._done or getattr(self._looking, "active", False):
            return None
        self._looking.active = True
        try:
            spec = importlib.util.find_spec("torch")
        finally:
            self._looking.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            if self._done:
                return
            self._done = True
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                on_torch_imported(module)
            except Exception as error:  # torch stays importable; the user is told why
                swapped = "zeroalloc.torch" in sys.modules and \
                    sys.modules["zeroalloc.torch"].installed()
                then = ("zeroalloc is PyTorch's allocator, without offload" if swapped
                        else "PyTorch goes on with its own allocator")
                print(f"zeroalloc: could not set up what the environment asks for at "
                      f"`import torch`: {error}; {then} "
                      "(set ZEROALLOC_DISABLE=1 to silence this)", file=sys.stderr)

        spec.loader.exec_module = exec_module
        return spec


try:
    torch_allocator_choice()  # a bad value is said at start-up, not deep inside torch
    zero_stage()
    sys.meta_path.insert(0, _TorchImportWatcher())
except Exception as error:  # the start-up hook must never keep Python from starting
    print(f"zeroalloc: the start-up hook did nothing: {error} "
          "(set ZEROALLOC_DISABLE=1 to silence it)", file=sys.stderr)
