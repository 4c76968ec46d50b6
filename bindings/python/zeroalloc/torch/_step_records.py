"""The records of the windowed step (_optimizer_step.py): a state in a window, a window
staged into scratch, what one step holds while it runs, and the bytes and residencies that
decide which states go through scratch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from zeroalloc import _offload
from zeroalloc._library import ZeroallocError
from zeroalloc.torch import _use_hints


@dataclass(eq=False)  # compared by identity: == would compare the tensors
class StateEntry:
    """One optimizer state in a window of the step, or (`state` None) the parameter's own
    data (Note [Parameters stepped where they are])."""

    __slots__ = ("state", "key", "home", "scratch", "pinned", "parameter", "version")
    state: "dict | None"  # the parameter's state dict; None: the entry is the parameter's data
    key: "str | None"  # the state's key in it
    home: "torch.Tensor"  # the state's own tensor (optimizer-state class), or parameter.data
    scratch: "torch.Tensor | None"  # its copy in a scratch buffer; None: stepped where it is
    pinned: bool  # pinned where it is (use_in_place), not yet ended
    parameter: "torch.Tensor"  # whose state it is
    version: int  # the home's version counter when it was staged


def is_parameter(entry: StateEntry) -> bool:
    return entry.state is None


def current(entry: StateEntry):
    """What the step reads and writes for the entry now: the state dict's tensor, or the
    parameter's data."""
    return entry.parameter.data if entry.state is None else entry.state.get(entry.key)


def put(entry: StateEntry, tensor) -> None:
    """Puts `tensor` where the step reads the entry: the state dict, or the parameter's data."""
    if entry.state is None:
        entry.parameter.data = tensor
    else:
        entry.state[entry.key] = tensor


class StagedWindow(NamedTuple):
    """A window whose states are pinned, and those bounced copied into scratch."""

    entries: list  # of StateEntry
    copied: "torch.cuda.Event | None"  # after the copies into scratch; None: none to copy


class WindowPlaces(NamedTuple):
    """Asked once for the next window to stage (a library call per state)."""

    number: int  # the window's
    places: dict  # id(state) -> its residency
    scratch_bytes: int  # the scratch its bounced states take


class StepScratch(NamedTuple):
    """How one step uses its scratch (Note [Windows and buffers])."""

    places: dict  # id(state) -> its residency, for the states the backward did not stage
    keep_from: int  # the first of the last windows whose states stay in scratch after it
    slot_count: int  # buffers: window n uses slot n mod slot_count
    queued: list  # per window: its StagedWindow once staged, else None


class StepRun:
    """What one step holds while it runs: what it puts back or ends when a window fails."""

    __slots__ = ("saved", "windows", "copies", "held", "swapped", "kept", "begun")

    def __init__(self, saved: list):
        self.saved = saved  # each param group's parameters, before any window narrowed them
        self.windows: list = []  # the windows stepped; none when it steps in one piece
        self.copies: "CopyStreams | None" = None  # the device's, once windows step
        self.held: list = []  # entries pinned and not yet ended
        self.swapped: list = []  # entries whose scratch is in the state dict now
        self.kept: list = []  # entries of the last windows, kept in scratch (succeeded only)
        self.begun = None  # the window's parameters whose use is open (not pinned with it)


class CopyStreams(NamedTuple):
    """A device's streams for copies into scratch and back."""

    copy_in: "torch.cuda.Stream"
    copy_out: "torch.cuda.Stream"


def padded(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def scratch_size(tensor) -> int:
    """A state's bytes in a scratch buffer (each starts 512-byte aligned)."""
    return padded(tensor.numel() * tensor.element_size())


def copied_bytes(entries, parameters: bool = True) -> int:
    """Scratch taken by the entries whose state (or, with `parameters`, parameter) is copied
    through it."""
    return sum(scratch_size(entry.home) for entry in entries
               if entry.scratch is not None and (parameters or not is_parameter(entry)))


def residency_or_foreign(tensor) -> str:
    """The tensor's residency; "foreign" for memory the engine does not manage."""
    pointer = _use_hints.storage_pointer(tensor)  # 0: no storage of its own (a DTensor)
    if not pointer:
        return "foreign"
    try:
        return _offload.residency_of(pointer)
    except ZeroallocError:
        return "foreign"


def is_bounced(tensor, places) -> bool:
    """Whether a state is copied through scratch: off the device, and laid out so that a
    contiguous copy has the same strides (else the kernels reach it where it is)."""
    return tensor.is_contiguous() and places[id(tensor)] not in ("device", "foreign")


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation the device limit could not serve: PyTorch's OutOfMemoryError, or the
    RuntimeError that carries zeroalloc_malloc's out-of-memory message (a device error that
    quotes the driver's "out of memory" is not one)."""
    return (isinstance(error, torch.cuda.OutOfMemoryError)
            or "zeroalloc_malloc: out of memory on " in str(error))
