"""ZeRO stages 2 and 3 with no code change in a script that wraps its model in
DistributedDataParallel.

Note [DistributedDataParallel under stages 2 and 3]: DistributedDataParallel all-reduces
every gradient into every rank, which is what stages 2 and 3 must not do (each gradient goes
to its owner alone), and it refuses a model whose parameters it is told to leave alone. So
under ZEROALLOC_ZERO_STAGE=2 or 3 the script's DistributedDataParallel(model, ...) builds a
stand-in instead: an instance of a subclass (so isinstance checks and ``.module`` work as
before) whose forward is the module's, whose ``no_sync()`` changes nothing (the gradients
of each micro-batch are reduced to their owners as they come, which gives the same sums),
and which, as DistributedDataParallel does, makes every rank's parameters and buffers rank
0's when it is built. It remembers the module, for stage 3's partition of the optimizer
built over it. Buffers are not broadcast again before each forward
(DistributedDataParallel's broadcast_buffers): a model whose buffers change in the forward
(batch norm's running statistics) keeps each rank's own.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

#: The modules wrapped so far, weakly (stage 3 partitions the one an optimizer steps).
wrapped: list = []


def stand_in_class():
    """The ZeroDataParallel class, made at first use: torch.nn.parallel is imported only by
    the scripts that use it (and the start-up hook may run with a torch that lacks it)."""
    global _stand_in
    if _stand_in is not None:
        return _stand_in

    class ZeroDataParallel(torch.nn.parallel.DistributedDataParallel):
        """What DistributedDataParallel(module, ...) builds under stages 2 and 3."""

        def __init__(self, module, *args, **kwargs):
            torch.nn.Module.__init__(self)
            self.module = module
            import torch.distributed as distributed
            if distributed.is_available() and distributed.is_initialized():
                with torch.no_grad():
                    for tensor in list(module.parameters()) + list(module.buffers()):
                        distributed.broadcast(tensor.data, src=0)
            wrapped.append(weakref.ref(module))

        def forward(self, *inputs, **kwargs):
            return self.module(*inputs, **kwargs)

        @contextlib.contextmanager
        def no_sync(self):
            yield

        def __getstate__(self):
            return torch.nn.Module.__getstate__(self)

        def __setstate__(self, state):
            torch.nn.Module.__setstate__(self, state)

    _stand_in = ZeroDataParallel
    return _stand_in


_stand_in = None


def replace_distributed_data_parallel() -> None:
    """From now on DistributedDataParallel(...) builds a ZeroDataParallel. Once per process."""
    import torch.nn.parallel  # noqa: F401 (the attribute below)
    parallel = torch.nn.parallel.DistributedDataParallel
    if getattr(parallel, "_zeroalloc_replaced", False):
        return
    stand_in = stand_in_class()

    def new(cls, *args, **kwargs):
        return torch.nn.Module.__new__(stand_in if cls is parallel else cls)

    parallel.__new__ = new
    parallel._zeroalloc_replaced = True


def model_of(parameters: list):
    """The wrapped module holding every one of `parameters`, or None."""
    wanted = {id(p) for p in parameters}
    for reference in reversed(wrapped):
        module = reference()
        if module is not None and wanted <= {id(p) for p in module.parameters()}:
            return module
    return None
