"""Use hints: the calls into the library that tell the offload engine when tensors are used
(begins, ends, in place), one call per device, each fenced on that device's stream."""

from __future__ import annotations

from typing import Iterable

import torch

from zeroalloc import _offload


def current_stream(device_index: "int | None" = None) -> int:
    """The current stream of a device (the current device when none is named), as an
    integer: the hooks ask for it once per module, and torch.cuda.current_stream() builds a
    Stream object each time."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return torch.cuda.current_stream(device_index).cuda_stream
    return raw(torch._C._cuda_getDevice() if device_index is None else device_index)


#: Called as f(tensors, stream) before every hint while not empty: a use may have to wait
#: for work behind it (Note [The host step finishes behind the forward] in _host_step.py).
before_use: list = []


def storage_pointer(tensor: "torch.Tensor") -> int:
    """Where the tensor's storage begins; 0 for a tensor with no storage of its own to
    manage: a wrapper subclass (FSDP2's DTensor: its storage is null, and asking for its
    data pointer raises), or a storage freed by resizing it to nothing (FSDP's unsharded
    parameters between uses)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def pointers(tensors: Iterable["torch.Tensor"]) -> list:
    """The storages of the tensors that have one (storage_pointer)."""
    return [pointer for tensor in tensors if (pointer := storage_pointer(tensor))]


def hint(call, tensors: Iterable["torch.Tensor"], stream: int) -> None:
    """One library call per device of the tensors, each fenced on that device's current
    stream unless `stream` is given: a model split over several GPUs in one process runs
    each part on its own device's stream, and a fence on another device's stream would let
    the engine move a chunk that the part's kernels still read."""
    tensors = tensors if isinstance(tensors, (list, tuple)) else list(tensors)
    for wait in list(before_use) if before_use else ():
        wait(tensors, stream)
    if stream or not tensors:
        call(pointers(tensors), stream or current_stream())
        return
    index = tensors[0].get_device()  # -1 for a tensor on the CPU
    if all(tensor.get_device() == index for tensor in tensors):
        call(pointers(tensors), current_stream(index if index >= 0 else None))
        return
    by_device: dict = {}
    for tensor in tensors:
        by_device.setdefault(tensor.get_device(), []).append(tensor)
    for index, part in by_device.items():
        call(pointers(part), current_stream(index if index >= 0 else None))


def begin(tensors: Iterable["torch.Tensor"], stream: int = 0) -> None:
    """Use-begins hints for the tensors, in one call into the library per device."""
    hint(_offload.use_begins_many, tensors, stream)


def end(tensors: Iterable["torch.Tensor"], stream: int = 0) -> None:
    hint(_offload.use_ends_many, tensors, stream)


class using:
    """``with zt.using(*tensors):`` hints a use of the tensors around the block: on entry
    each is on the device (or, with no room there, reachable on the host), and it stays
    put until the block ends. For reads the module hooks do not see, of parameters that
    ZEROALLOC_PARK_PARAMETERS may leave behind unmapped addresses (Note [Parameters parked]
    in lib/tier/offload_engine.hpp): a norm for a log, an EMA update, a functional call on a
    weight of a module the model never calls. Work queued on the current stream inside the
    block is covered; tensors the engine does not manage are ignored."""

    def __init__(self, *tensors: "torch.Tensor"):
        self.tensors = [t for t in tensors if torch.is_tensor(t) and t.is_cuda and t.numel() > 0]

    def __enter__(self):
        if self.tensors:
            begin(self.tensors)
        return self

    def __exit__(self, *exc) -> None:
        if self.tensors:
            end(self.tensors)
