"""Moving allocations between device and host memory by hand, and the hints the offload
engine learns its access order from. Needs ZEROALLOC_OFFLOAD=host; pointers are the start of
zeroalloc allocations (a tensor's data_ptr() when zeroalloc is PyTorch's allocator)."""

from __future__ import annotations

import contextlib
import ctypes
import threading

from zeroalloc._library import AdamWSettings, ZeroallocError, last_error, library

#: zeroalloc_residency's answers.
RESIDENCY = {0: "device", 1: "host", 2: "split", 3: "moving", 4: "disk", 5: "host_unmapped"}


def offload_pointer(pointer: int, wait: bool = True) -> None:
    """Moves the allocation at `pointer` to pinned host memory (same address)."""
    if library().zeroalloc_offload(pointer, int(wait)) != 0:
        raise ZeroallocError(last_error())


def fetch_pointer(pointer: int, wait: bool = True) -> None:
    """Brings the allocation at `pointer` back to device memory (a chunk with a use open
    stays where it is)."""
    if library().zeroalloc_fetch(pointer, int(wait)) != 0:
        raise ZeroallocError(last_error())


def residency_of(pointer: int) -> str:
    """"device", "host", "host_unmapped" (Note [Parameters parked]), "disk", "split" or
    "moving"."""
    answer = library().zeroalloc_residency(pointer)
    if answer < 0:
        raise ZeroallocError(last_error())
    return RESIDENCY[answer]


def use_begins(pointer: int, stream: int = 0) -> None:
    library().zeroalloc_use_begins(pointer, stream or None)


def use_in_place(pointer: int, stream: int = 0) -> None:
    library().zeroalloc_use_in_place(pointer, stream or None)


def use_ends(pointer: int, stream: int = 0) -> None:
    library().zeroalloc_use_ends(pointer, stream or None)


def _array(pointers: list):
    return (ctypes.c_void_p * len(pointers))(*pointers)


def use_begins_many(pointers: list, stream: int = 0) -> None:
    """use_begins for each pointer, in one call (one lock in the engine)."""
    if pointers:
        library().zeroalloc_use_begins_many(_array(pointers), len(pointers), stream or None)


def use_in_place_many(pointers: list, stream: int = 0) -> None:
    if pointers:
        library().zeroalloc_use_in_place_many(_array(pointers), len(pointers), stream or None)


def use_ends_many(pointers: list, stream: int = 0) -> None:
    if pointers:
        library().zeroalloc_use_ends_many(_array(pointers), len(pointers), stream or None)


#: Note [A use the boundary waits for]: the step boundary closes every open use, so that a
#: hint never ended cannot pin its chunk for good. A use that another thread holds open is
#: not such a hint. The host step's thread copies the CPUs' results into the working copies
#: on its own stream, inside a use, while the next step may already have begun (Note [The
#: host step finishes behind the forward]). A boundary that closed that use let the engine
#: move the chunk while the copies were still being queued. They then wrote the backing the
#: chunk had left, and the next forward read the old weights: under ZEROALLOC_ACCESS=hinted,
#: three runs in four of the host step's test drifted from the others, at random. Such a use
#: is held (use_held), and the boundary waits until no held use is open.
_held = threading.Lock()


@contextlib.contextmanager
def use_held(pointers: list, stream: int):
    """A use of the allocations at `pointers` on `stream`, begun and ended on this thread,
    that no step boundary closes while it is open (Note [A use the boundary waits for])."""
    with _held:
        use_begins_many(pointers, stream)
        try:
            yield
        finally:
            use_ends_many(pointers, stream)


def step_boundary() -> None:
    """Closes every use but the held ones, which it waits for (Note [A use the boundary
    waits for]), and starts the next step of the learned order and the report."""
    with _held:
        library().zeroalloc_step_boundary()


def adamw_on_host(parameters: list, gradients: list, exp_avgs: list, exp_avg_sqs: list,
                  counts: list, lr: float, betas: tuple, eps: float, weight_decay: float,
                  step: int, maximize: bool = False, stream: int = 0) -> bool:
    """One AdamW step of float32 tensors (pointers: allocation starts; a gradient may be host
    memory) on the host's CPUs, where the engine holds them (Note [Stepped on the host] in
    lib/tier/host_step.hpp). True when stepped; False when some allocation is not on the
    host (nothing changed: step on the device). Raises HostStepUnavailable when no call can
    step on this driver."""
    if not parameters:
        return True
    settings = AdamWSettings(float(lr), float(betas[0]), float(betas[1]), float(eps),
                             float(weight_decay), int(step), int(bool(maximize)))
    answer = library().zeroalloc_adamw_on_host(
        _array(parameters), _array(gradients), _array(exp_avgs), _array(exp_avg_sqs),
        (ctypes.c_size_t * len(counts))(*counts), len(parameters), ctypes.byref(settings),
        stream or None)
    return host_step_answer(answer)


def adamw_on_host_bf16(masters: list, gradients: list, exp_avgs: list, exp_avg_sqs: list,
                       copies: list, counts: list, lr: float, betas: tuple, eps: float,
                       weight_decay: float, step: int, maximize: bool = False,
                       stream: int = 0) -> bool:
    """adamw_on_host for fp32 masters of bf16 working copies (Note [Master weights] in
    torch/_master_weights.py): each gradient is bf16 host memory of the caller's, and each
    updated master is also written, rounded to bf16, into `copies` (host memory of the
    caller's). Same answers as adamw_on_host."""
    if not masters:
        return True
    settings = AdamWSettings(float(lr), float(betas[0]), float(betas[1]), float(eps),
                             float(weight_decay), int(step), int(bool(maximize)))
    answer = library().zeroalloc_adamw_on_host_bf16(
        _array(masters), _array(gradients), _array(exp_avgs), _array(exp_avg_sqs),
        _array(copies), (ctypes.c_size_t * len(counts))(*counts), len(masters),
        ctypes.byref(settings), stream or None)
    return host_step_answer(answer)


def host_step_answer(answer: int) -> bool:
    if answer < 0:
        raise ZeroallocError(last_error())
    if answer == 2:
        raise HostStepUnavailable("the driver does not open host memory mapped through it to "
                                  "the CPUs: the optimizer steps on the device")
    return answer == 1


class HostStepUnavailable(ZeroallocError):
    """zeroalloc_adamw_on_host can never step on this driver (it answered 2)."""


def host_adamw_rate(device: int, parameters: int = 0) -> float:
    """Parameters a second that the host step's CPUs (`device`'s NUMA node) run AdamW at with
    master weights, measured now over `parameters` of them (0: 64 Mi, 1 GiB for the call)."""
    rate = ctypes.c_double()
    if library().zeroalloc_host_adamw_rate(device, parameters, ctypes.byref(rate)) != 0:
        raise ZeroallocError(last_error())
    return rate.value


def pinned_create(device: int, nbytes: int) -> int:
    """The address of a pinned host buffer of at least `nbytes` for copies with `device`, on
    its NUMA node (Note [Pinned buffers made ahead] in lib/tier/pinned_buffers.hpp). It takes
    about 0.25 s a GiB, without the interpreter: other threads run meanwhile. Raises
    ZeroallocError when the host cannot spare it (its reserve) or the driver refuses."""
    address = ctypes.c_void_p()
    if library().zeroalloc_pinned_create(device, nbytes, ctypes.byref(address)) != 0:
        raise ZeroallocError(last_error())
    return address.value


def pinned_release(address: int, stream: int = 0) -> None:
    """Releases a buffer of pinned_create's once the work queued so far on `stream` is done."""
    if library().zeroalloc_pinned_release(address, stream or None) != 0:
        raise ZeroallocError(last_error())


def pinned_bytes(device: int) -> int:
    """Bytes pinned_create's buffers hold on `device` now."""
    held = library().zeroalloc_pinned_bytes(device)
    if held < 0:
        raise ZeroallocError(last_error())
    return held


#: zeroalloc_log's levels.
LOG_LEVELS = {"debug": 1, "info": 2, "warn": 3, "error": 4}


def log(level: str, message: str) -> None:
    """Writes `message` to the library's log (ZEROALLOC_LOG_FILE, else standard error) at
    `level` (debug, info, warn or error), as the library's own messages go."""
    if library().zeroalloc_log(LOG_LEVELS[level], message.encode()) != 0:
        raise ZeroallocError(last_error())
