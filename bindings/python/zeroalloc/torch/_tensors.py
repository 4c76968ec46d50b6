"""Moving one tensor's storage between device and pinned host memory, and asking where it
is."""

from __future__ import annotations

import torch

from zeroalloc import _offload
from zeroalloc.torch._step_listeners import windowed_steps


def offload_tensor(tensor: "torch.Tensor", wait: bool = True) -> None:
    """Moves the tensor's storage to pinned host memory; its address, and every view of it,
    stay valid (kernels reach it over PCIe until it comes back). With `wait=False`, queue no
    work on the tensor until `residency(tensor)` stops answering "moving". Memory it shares
    a chunk with, in use by a hinted module or optimizer step, stays on the device. An
    optimizer state that the last windowed step kept in device scratch (Note [Overlapping
    the step]) is written back first, and its own tensor is moved."""
    _offload.offload_pointer(home_of(tensor).untyped_storage().data_ptr(), wait)


def fetch_tensor(tensor: "torch.Tensor", wait: bool = True) -> None:
    """Brings the tensor's storage back to device memory (a kept optimizer state: its own
    tensor's, as offload_tensor)."""
    _offload.fetch_pointer(home_of(tensor).untyped_storage().data_ptr(), wait)


def residency(tensor: "torch.Tensor") -> str:
    """Where the tensor's storage is: "device", "host", "host_unmapped" (a parameter parked on
    the host behind unmapped addresses: ZEROALLOC_PARK_PARAMETERS), "disk", "split" or
    "moving" (a kept optimizer state: its own tensor's, as offload_tensor)."""
    return _offload.residency_of(home_of(tensor).untyped_storage().data_ptr())


def home_of(tensor):
    """The tensor itself, or for an optimizer state kept in scratch, its own tensor, once
    written back (the scratch is not the optimizer-state class's, and moving it would race
    the write-back)."""
    stepper = windowed_steps.keeping(tensor)
    if stepper is None:
        return tensor
    for entry in stepper.kept:
        if entry.state.get(entry.key) is tensor:
            stepper.write_back_kept(wait=True)
            return entry.home
    return tensor
