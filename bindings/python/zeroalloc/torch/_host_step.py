"""AdamW windows stepped on the host's CPUs where their states are (ZEROALLOC_HOST_STEP; Note
[Stepped on the host] in lib/tier/host_step.hpp).

Note [Host windows]: the windowed step asks, before it stages anything, which of its
windows have every parameter and state on the host (the residency it asks anyway). Those
windows are not bounced: their gradients are copied into pinned host memory on a copy
stream, all queued before the CPUs begin (Note [Gradients queued ahead]; else one window
ahead of the CPUs), and the library steps each window on the CPUs of the
GPU's NUMA node, reading and writing the states and parameters at their host copies. The
parameters stay on the host; the next forward fetches them as it fetches any evicted
parameter. A window the engine moved meanwhile (the library answers that a chunk is on the
device) is staged and stepped on the device as any other. Only torch.optim.AdamW (and Adam
without weight decay, the same update), fp32, without amsgrad, capturable or differentiable
runs here; the rest steps on the device. With master weights (Note [Master weights] in
_master_weights.py) the gradients copied are the working copies' bf16 ones, and the CPUs
write each updated master rounded to bf16 into pinned buffers, copied into the working
copies on the same stream, which the step's stream waits for.

Note [The host step finishes behind the forward]: with master weights the CPUs' windows are
the step's long pole (28 bytes of host memory a parameter), and the device idles meanwhile.
Stepping some of the host's windows on the device instead gained nothing: their copies up
and back move 24 bytes a parameter through the same host memory, and the CPUs slowed by as
much as they were spared (bench/RESULTS.md, 2026-12-06). The CPUs' pass runs at the host's
memory bandwidth: AdamW at 102% of the rate of moving its bytes with no arithmetic
(host_step_bench --masters, same). So optimizer.step() may return once the device's windows
are done (under hinted; ZEROALLOC_HOST_STEP_OVERLAP=0 turns it off), and the CPUs finish
theirs while the next forward runs. The forward reads only the working copies, each written
on the copy stream after its window: a hinted use of one (a module's forward, zt.using)
first waits for the CPUs to finish its window, then orders its stream after that window's
copies. The CPUs step the windows in the order of the parameters, which is about the order
of the forward, so the forward runs right behind them.
Everything else that reads or writes what the CPUs hold waits for all of it: the next step,
zero_grad(set_to_none=False), the model's or the optimizer's state_dict and load_state_dict,
OffloadHandle.remove(), and the process's exit. Every gradient is copied to the host when
the step returns (one pinned buffer), so zero_grad frees the device's gradients as before.
The CPUs' uses of the chunks outlive the step boundary (the engine keeps them), so nothing
moves under them. A call the library refuses (a chunk moved to the device meanwhile) keeps
its bf16 gradients on the host; the parameters are stepped on the device when a use waits
for their window, from those gradients. Only with module hints (a read the hints do not see
could find a working copy not yet written), and only when every window on the host is of
masters.

Note [Behind the forward under hinted]: runs that finished behind the forward once differed
from each other. Six runs of the host step's GPU script (320 MiB limit) agreed through step
2 and parted at steps 3 to 5, 1e-3 from the plain recipe (bench/RESULTS.md, 2026-12-06).
Step 3's forward is the first that runs behind the CPUs. The cause: the forward runs on the
default stream, whose handle is 0, and the wait for the window's copies went to
torch.cuda.ExternalStream(0). That is a new stream from PyTorch's pool, not the default
stream. So the forward never waited for the copies, and read weights they were still
writing. Waits now go on the stream itself (stream_of). Four runs at once are then
identical to the bit. No hinted use read other bytes than those that stayed
(bench/RESULTS.md, 2026-12-06 22:0x). Guarded runs under any went through the same wait,
yet were exact in every run measured. Each of their calls is intercepted, which likely
left the copies time.

Note [Whole masters on the host]: the engine moves chunks, least recently used first, to
make room during the forward and backward, so under a limit the host ends up holding parts
of masters: a moment here, a master's chunk there. The CPUs step only a master whose every
byte is on the host; any other is bounced through device scratch, all its host bytes in and
out over PCIe every step, and the step waits for that (at 24.8 GiB of the 1.3B bench model,
2.3 GiB a step while the CPUs stepped one window). So with master weights, the step first
makes masters whole on one side (which ones: below; each direction's moves queued
together, then waited for), and the CPUs step those on the host from then on (1.14 x at
24.8 GiB for the first rule alone, bench/RESULTS.md). Nothing fetches states between
steps (the step reaches them where they are), so in a steady loop the moves happen once,
and again only when the engine had to move more. For the same reason, staging during the
backward (Note [Overlapping the step] in _optimizer_step.py) leaves windows with states on
the host to the step. Only masters move: the model's own fp32 weights are what the next
forward uses. When the host tier refuses a move (ZEROALLOC_HOST_LIMIT), it warns once, and
partial masters are bounced as before.

Which masters, and how many bytes: the masters evicted are the first windows' (stepped
longest ago), and they are parts of more masters than their bytes make (at 24.8 GiB, 4.2
GB evicted made 6.2 GB of whole masters). Made whole where they are, the CPUs step 50%
more than the engine needed, and the forward waits for them at its first layer. So by
default (`last_on_host`) the step trades them: the fewest last masters, whole, that hold as
many bytes as the host held of masters go there, and the others come back (out first,
which makes the room; a net move of nothing, so the next forward needs no more room than
the last). The CPUs then step the last layers while the forward runs the first, and step
only what the limit takes. At 24.8 GiB of the 1.3B bench model: 26.4k tokens/s against
20.9k for completion where they are, side by side, host 4.1 GiB against 5.8 (bench/
RESULTS.md). A chunk holds bytes of two masters, so a move can take part of a neighbour
along: residency is asked again after the moves, and a master brought back once, or
dragged partly to the host by a neighbour's move, stays so (bounced: a chunk's bytes over
PCIe), else the line would move one master a step.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import sys
import threading
import time
import warnings
import weakref
from typing import NamedTuple

import torch

from zeroalloc import _offload, _stats
from zeroalloc._library import ZeroallocError, library
from zeroalloc.torch import _settings, _use_hints
from zeroalloc.torch._step_records import is_out_of_memory, residency_or_foreign

#: Note [The CPUs' windows]: the step's windows are sized for device scratch (at most a
#: sixteenth of the limit), which the CPUs need none of, and each window the CPUs step costs
#: milliseconds of its own: its copies queued, a library call per group, the workers woken
#: and joined, the uses opened and ended. On the 1.3B Llama at 13.3 GiB, 15 windows a step
#: spent 0.07 s outside the library's calls and 0.32 s in them, where the CPUs' rate alone
#: gives 0.21 to 0.24 s (H100, bench/RESULTS.md). The CPUs can therefore step consecutive
#: host windows merged, up to window_parameters parameters each: fewer, larger calls, at a
#: few milliseconds more before the first window's gradients are on the host and after the
#: last one's copies. Merged at 512 M, side by side with the windows alone in one call, the
#: fast recipe ran 1.09 x at 13.3 GiB and 1.20 x at 24.8 GiB (H100, bench/RESULTS.md). So
#: they merge by default (0: each window alone). The pinned buffers for the CPUs' bf16
#: masters grow with the window: two of them, 1 GiB each for a merged window of masters.
#: A window is a library call per group (the Trainer makes two: weights with decay, the
#: rest without). Its calls lay their masters out one after the other in its buffer, so the
#: CPUs wait for the buffer's last copies once a window, and no call waits for another's.
HOST_WINDOW_PARAMETERS = 512 << 20

#: Note [The run's ends in pieces]: the CPUs start a window once all its gradients are on
#: the host, and its bf16 masters go back once the CPUs are done with it. So the copies of
#: the first window's gradients and of the last window's masters lie bare at the step's two
#: ends: 1 GB each way for a merged window of 512 M parameters, about 0.02 s at 55 GB/s. At
#: 24.8 GiB the 1.3B Llama's step phase took 0.087 s for the CPUs' 0.059 s (H100,
#: bench/RESULTS.md, 2026-12-06). In pieces, the run's first window steps its first
#: piece_parameters parameters (at least) as soon as their own copies are done, while the
#: rest arrive. The run's last window steps its last piece_parameters apart, so the copies
#: back of the rest run meanwhile. A piece is one more library call per group in the same
#: turn. The pieces of a window share its pinned buffer for the masters at distinct offsets,
#: so no call waits for another's copies back. Splitting the ends into turns of their own
#: ran slower (bench/RESULTS.md, 2026-12-06 00:3x). Only with the gradients queued ahead
#: (Note [Gradients queued ahead]). At 24.8 GiB, pieces of 64 M parameters took the wait
#: for the first window's gradients from 0.011-0.012 to 0.001-0.002 s. Run first, they took
#: the step phase from 0.157 to 0.121 s; run second, on another host, the two were even
#: (0.276 against 0.280 s a step). At 13.3 GiB they were even too (0.603 against 0.606 s;
#: H100, bench/RESULTS.md, 2026-12-06). Never slower, so the ends go in pieces by default
#: (0: whole windows). The bench's --host-piece-parameters N,0 runs both side by side.
HOST_PIECE_PARAMETERS = 64 << 20


def piece_ends(counts: list, first: bool, last: bool, size: int) -> list:
    """Note [The run's ends in pieces]: where the pieces of a window end (exclusive indices
    into its parameters, of `counts` elements each). The run's `first` window gets a first
    piece of at least `size` elements, its `last` a last piece of at least `size`, and the
    rest lies between. A piece that would be the whole window, or would overlap another, is
    not made."""
    ends = []
    if size and first:
        total, end = 0, 0
        while end < len(counts) and total < size:
            total += counts[end]
            end += 1
        if end < len(counts):
            ends.append(end)
    if size and last:
        total, begin = 0, len(counts)
        while begin > 0 and total < size:
            begin -= 1
            total += counts[begin]
        if begin > (ends[-1] if ends else 0):
            ends.append(begin)
    return ends + [len(counts)]

#: Note [Gradients queued ahead]: the CPUs' thread needs the interpreter for each PyTorch
#: call it makes, about four a parameter to queue a window's gradients' copies. While the
#: step's thread steps windows on the device, each of those calls may wait for it. On the
#: 1.3B Llama at 13.3 GiB, with merged windows, queueing took 0.13 to 0.22 s a step
#: (averaged over the run, warm-up included), all of it on the CPUs' path (H100,
#: bench/RESULTS.md). So the step's thread queues every
#: window's copies into one pinned buffer before the CPUs' thread starts, as it does for a
#: run that finishes behind the forward. Side by side, in either order, that ran 1.19 x and
#: 1.22 x queueing by the CPUs' thread (8,663 against 7,301 and 9,641 against 7,892
#: tokens/s). The buffer holds every gradient the CPUs read: 2 bytes a parameter with
#: masters (2.7 GB for the 1.3B model), in place of two windows' worth. Pinned memory is
#: never swapped (Note [Host budget] in lib/tier/host_pool.hpp), so the buffer takes at most
#: an eighth of the host's memory: a run that needs more queues window by window (a 7B
#: model needs 13.4 GB, which a host of 128 GiB gives and one of 64 GiB does not). Only
#: runs whose every parameter is a master queue ahead: without masters the buffer would
#: hold 4 bytes a parameter, and a gradient the engine moved to the host is read there.
#: False: the CPUs' thread queues each window's copies (the bench's
#: --queue-gradients-ahead 0,1 runs both side by side).
QUEUE_GRADIENTS_AHEAD = True

#: Note [Windows prepared ahead]: with the copies queued ahead, the CPUs' thread still makes
#: PyTorch calls a parameter of its own: the step count read, the views of the pinned
#: buffer for the bf16 masters, the count raised after the call, and the copy of the bf16
#: master into its working copy. Each of those that lets go of the interpreter may wait for
#: it while the step's thread runs the device's windows. With prepare_ahead, the step's
#: thread prepares every window's calls (their addresses, buffer views and the working
#: copies flattened) before the CPUs' thread starts. That thread then raises the counts
#: with one PyTorch call a library call, and queues the copies back with another. Only with
#: the copies queued ahead. A window in pieces (Note [The run's ends in pieces]) is planned
#: piece by piece instead. Off by default until measured; the bench's
#: --prepare-windows-ahead 0,1 runs both side by side.
PREPARE_WINDOWS_AHEAD = False

#: Note [Pinned buffers made ahead] (lib/tier/pinned_buffers.hpp): PyTorch's pinned
#: allocator makes the host step's buffers in the first host step, each rounded up to a
#: power of two. With pin_ahead, the library makes them instead, from the first forward on,
#: on a thread of their own: one for every master's bf16 gradient (the buffer of Note
#: [Gradients queued ahead], within its budget), and two for a merged window's bf16 masters
#: (Note [The CPUs' windows]). That is every master, not only those the host will hold: the
#: first forward cannot know which. So they are made only when the masters, their moments,
#: working copies and gradients (16 bytes a parameter) exceed the device's limit. The step
#: takes them when it first needs them, and waits for the thread if it has not finished. A
#: buffer the host cannot spare beside its reserve and what the host tier may still take up
#: to its limit is left to the step. The bench's --pin-buffers-ahead 0,1 runs both side by
#: side. Measured on the H100 (bench/RESULTS.md, 2026-12-06): the 1.3B Llama's step 1 fell
#: from 2.85 to 1.13 s and its step 0 rose from 3.17 to 4.27 s; the 7B at 24 GiB, before
#: the host tier's room was kept, ran at a quarter of its speed. Off until measured again.
PIN_BUFFERS_AHEAD = False

#: Note [Behind the forward, guarded]: under ZEROALLOC_ACCESS=any the CPUs finish within the
#: step, because a read the hints do not see (an EMA, a norm for a log) could find a working
#: copy not yet written. With guard_behind, a run of masters may finish behind the next
#: forward under `any` too, where the step can show that every read goes through the
#: parameter object. Each working copy of the run is then of class GuardedParameter until
#: the run's copies are done. Its __torch_function__ sees every PyTorch call that takes it,
#: on any thread, and makes the call wait for the copy's window and order its stream after
#: the window's copies (calls that read no bytes, such as .grad or .shape, do not wait).
#: What the step shows first (guard_proof): each working copy is a plain nn.Parameter, no
#: other tensor holds its storage (a view kept across steps, .data held in a list: the
#: storage's use count), no CUDA graph was ever captured in this process (its replays read
#: through pointers), and torch.compile has compiled nothing in it (a compiled graph takes
#: parameters as inputs and would see the class change). Not seen: raw pointers taken outside
#: PyTorch's calls (a C++ extension called through pybind11 with a parameter outside its
#: module's forward), torch.distributed's collectives on a parameter, a storage object held
#: across steps.
#: Off by default: ZEROALLOC_HOST_STEP_GUARDED=1 asks for it. The bench's --guard-behind 0,1
#: runs both side by side.
GUARD_BEHIND = False

#: Note [States made where the CPUs step them]: torch.optim's AdamW makes a parameter's
#: moments in its first step, on the parameter's device. So the first step stepped every
#: master on the device. The next forward then moved the moments of the masters the host
#: holds out to the host (7 GB for the 1.3B Llama at 13.3 GiB). The step after also paid
#: for the CPUs' first run: their pinned buffers, and the first pass over the moments. On
#: the H100 that step took 8.8 x the steady step, and 2.6 x with the buffers pinned ahead
#: (bench/RESULTS.md, 2026-12-06). With make_states_on_host, the first step makes these
#: moments itself, as AdamW makes them: a step count of 0 on the CPU, and zeros shaped as
#: the master, in the optimizer-state class. It moves them to the host at once. The CPUs
#: then step those masters in the first step, and every cost of their first run lands
#: there. Only masters wholly on the host, without states, that the CPUs can step (their
#: AdamW settings, a bf16 working copy and gradient): AdamW would make exactly these
#: states. Every parameter the step will make states for gets its entry in the optimizer's
#: state first, in the order of param_groups, so its state_dict lists them as AdamW's own
#: first step does. A move the host tier refuses warns once, and AdamW makes the rest.
#: The host step's pinned buffers (PyTorch's) are then made in the first step too, before
#: the host tier grows in the second step's backward. A 7B model at 24 GiB, with the host
#: tier's limit at 100 of 126 GiB, then ran the host out of memory in its second step. So
#: the first step makes the moments only when the host can pin those buffers and still
#: leave two things: what the tier may create up to its limit, and the tier's reserve. Else
#: AdamW makes them, and the buffers come in the second step, as before. The log is then
#: told once what is missing, and which ZEROALLOC_HOST_LIMIT leaves the room. The same 7B
#: with the limit at 88 GiB made its moments on the host, and its second step took 1.1 x a
#: later one, against 4.6 x with the limit at 100 GiB (bench/RESULTS.md). Buffers the
#: library made ahead (Note [Pinned buffers made ahead]) are held already and need no room.
#: The bench's --moments-on-host 0,1 runs both side by side.
MAKE_STATES_ON_HOST = True
#: Note [The first step's room]: the above makes moments only for masters the host holds
#: already. Under a limit the first forward and backward fit, the host holds none of them:
#: the 1.3B Llama at 24.8 GiB peaks near 20 GiB before it has moments, and AdamW's 10 GiB of
#: moments then overflow the limit. AdamW made them on the device. The next forward moved
#: 7.7 GB of states out, least recently used first, so parts of many masters. The second
#: step then traded them for the last masters whole (Note [Whole masters on the host]),
#: 4 GB each way, and paid the CPUs' first run: 1.7-2.5 s, 6-9 x a later step (bench/
#: RESULTS.md). So the optimizer's first step asks what the moments will overflow: the
#: device's peak allocation, plus two moments for each master still on the device, less the
#: limit (the device's memory when none was set). The peak must be this step's own: one
#: above the peak when the first forward after offload() began (a checkpoint loaded or an
#: evaluation before it could leave a higher one). Else nothing moves, as before. The last
#: masters on the device, each worth its bytes and its moments' (three times its own), go to
#: the host, whole, until they cover that. Their moments are then made there, and the CPUs
#: step them in the first step. They are the masters the trade would choose, so the second
#: step finds nothing to trade when the estimate holds. A master that shares a chunk with
#: one sent, and went partly along, stays so, bounced, as with the trade. The estimate can
#: only fall short: the step's own scratch and the allocator's slack are not in it. The
#: engine then moves what is missing, and the trade makes it whole, as before. At 24.8 GiB
#: the first step sent 1.04 GiB of masters, and the second traded 0.57 GiB out and 0.50 back
#: (3.81 and 3.70 without this). That step took 3.6 x a later one, against 7.5 x, side by
#: side, and the later steps were no slower (bench/RESULTS.md). The 0.57 GiB was about the
#: headroom the engine keeps free below the limit for fetches ahead (ZEROALLOC_PREFETCH_BYTES,
#: 512 MiB): the device holds the limit less that. So the estimate counts it too, as the step
#: model's placement does (plan_host in zeroalloc/_step_model.py). Not yet measured.
#: Nothing moves without room for the host step's buffers. A move the host tier refuses
#: warns, and AdamW makes the moments of the masters left on the device there. The bench's
#: --first-step-room 0,1 runs both side by side.
ROOM_FIRST = True
#: About the device memory the moments of one batch take before they move (Note [States
#: made where the CPUs step them]); a batch holds one master at least.
STATE_BATCH_BYTES = 512 << 20

ON_HOST = ("host", "host_unmapped")
PARTLY_ON_HOST = ON_HOST + ("split",)  # "split" with a chunk on disk is never all on the host


def adamw_settings(optimizer, group) -> "dict | None":
    """The group's AdamW settings when the host step can run them, else None."""
    # A subclass may step otherwise; a fused step unscales a GradScaler's gradients and skips
    # steps that overflowed inside its kernel (grad_scale, found_inf), which the host step
    # does not do.
    if (getattr(optimizer, "grad_scale", None) is not None
            or getattr(optimizer, "found_inf", None) is not None or group.get("fused")):
        return None
    if type(optimizer) is torch.optim.AdamW:
        decoupled = True
    elif type(optimizer) is torch.optim.Adam:
        decoupled = bool(group.get("decoupled_weight_decay", False))
        if not decoupled and group.get("weight_decay", 0) != 0:
            return None  # L2 added to the gradient: another update
    else:
        return None
    if (group.get("amsgrad") or group.get("capturable") or group.get("differentiable")
            or not decoupled and group.get("weight_decay", 0) != 0):
        return None
    lr = group["lr"]
    lr = float(lr.item()) if torch.is_tensor(lr) else float(lr)
    beta1, beta2 = (float(b.item()) if torch.is_tensor(b) else float(b) for b in group["betas"])
    return {"lr": lr, "betas": (beta1, beta2), "eps": float(group["eps"]),
            "weight_decay": float(group.get("weight_decay", 0.0)),
            "maximize": bool(group.get("maximize", False))}


def host_memory_bytes() -> int:
    """The host's physical memory (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 0


def available_host_bytes() -> int:
    """The host's available memory (MemAvailable; 0 where the system does not say)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def power_of_two(nbytes: int) -> int:
    """The least power of two at least `nbytes` (1 for 0)."""
    return 1 << max(0, nbytes - 1).bit_length()


def move_together(move, tensors: list) -> None:
    """Moves the allocations of `tensors` with `move` (_offload.offload_pointer or
    fetch_pointer): all queued first, then waited for, so the moves overlap."""
    pointers = [tensor.untyped_storage().data_ptr() for tensor in tensors]
    for pointer in pointers:
        move(pointer, wait=False)
    for pointer in pointers:
        move(pointer, wait=True)


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """Pinned host memory for at least `nbytes`, from PyTorch's pinned allocator.

    Note [Buffers as large as their blocks]: that allocator rounds each request up to a
    power of two and pins the whole block. So the host step's buffers take the whole block.
    A later run that needs a little more then uses the same buffer. Without this, it pinned
    a new block of the same size. That happens in the second step when the trade adds
    masters to what the first step sent to the host (Note [The first step's room]). Pinning
    is slow: at 24.8 GiB of the 1.3B Llama, queueing the gradients' copies took 0.42 s in
    the CPUs' first run, against 0.001 s in a later one (bench/RESULTS.md). The memory
    pinned is the same either way."""
    return torch.empty(power_of_two(nbytes), dtype=torch.uint8, pin_memory=True)


class BufferRoom(NamedTuple):
    """What room_for_buffers weighs, in bytes: the buffers still to pin, the host's
    available memory, the host tier's limit and what it created, and its reserve."""

    need: int
    available: int
    limit: int
    created: int
    reserve: int

    @property
    def growth(self) -> int:
        """What the host tier may still create up to its limit."""
        return max(0, self.limit - self.created)

    @property
    def short(self) -> int:
        """The bytes missing for the buffers (0 when they fit)."""
        return max(0, self.need - (self.available - self.growth - self.reserve))


def room_limit_gib(room: BufferRoom) -> "int | None":
    """The host tier's limit, in whole GiB, that would leave `room` the buffers' bytes; None
    when even that would be at or below what the tier created already."""
    limit = (room.limit - room.short) // (1 << 30)
    return limit if limit * (1 << 30) > room.created else None


def room_section(room: BufferRoom) -> dict:
    """The memory report's "host_step" section when the first step leaves the moments to
    AdamW for want of room (doctor repeats it)."""
    limit = room_limit_gib(room)
    return {"first_step_states": "left to AdamW on the device",
            "buffers_bytes": room.need, "room_short_bytes": room.short,
            "available_bytes": room.available, "host_tier_growth_bytes": room.growth,
            "reserve_bytes": room.reserve,
            "suggested_host_limit": f"{limit}GiB" if limit is not None else None}


def room_message(room: BufferRoom) -> str:
    """Note [States made where the CPUs step them]: the log's line when the first step
    leaves the moments to AdamW for want of room for the buffers. It names the limit (whole
    GiB) that would leave the room, where one above what the tier holds would."""
    gib = 1 << 30
    lines = ["zeroalloc: the first step leaves the new optimizer states to AdamW on the "
             f"device. The host step's pinned buffers need {room.need / gib:.1f} GiB. "
             f"The host has {room.available / gib:.1f} GiB available. "
             f"The host tier may still create {room.growth / gib:.1f} GiB up to "
             f"ZEROALLOC_HOST_LIMIT, and keeps {room.reserve / gib:.1f} GiB in reserve. "
             f"So {room.short / gib:.1f} GiB are missing. "
             f"The second step then moves these states to the host, and takes several times "
             f"a later step."]
    limit = room_limit_gib(room)
    if limit is not None:
        lines.append(f"ZEROALLOC_HOST_LIMIT={limit}GiB or less leaves the room, if the host "
                     f"tier still holds what the model puts there.")
    else:
        lines.append("Freeing host memory leaves the room.")
    return " ".join(lines)


def place_of(tensor, places: dict) -> str:
    """The tensor's residency as `places` holds it, asked now (and kept there) when absent."""
    place = places.get(id(tensor))
    if place is None:
        place = places[id(tensor)] = residency_or_foreign(tensor)
    return place


def whole_fp32(tensor) -> bool:
    """A float32 tensor that is its storage's whole allocation, from its start."""
    return whole(tensor, torch.float32)


def whole(tensor, dtype) -> bool:
    """A `dtype` tensor that is its storage's whole allocation, from its start."""
    return (tensor.dtype == dtype and tensor.is_contiguous()
            and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


def step_count_zero():
    """A step count as torch.optim's Adam and AdamW make it for a group neither fused nor
    capturable: a CPU scalar of the optimizers' scalar dtype."""
    from torch.optim import optimizer as optimizers
    scalar_dtype = getattr(optimizers, "_get_scalar_dtype", None)
    return torch.tensor(0.0, dtype=scalar_dtype() if scalar_dtype is not None
                        else torch.float32)


def aligned(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


class HostStep:
    """The host side of one windowed step's windows (Note [Host windows])."""

    def __init__(self):
        self.buffers = [None, None]  # pinned host memory for the gradients, double-buffered
        # Note [Master weights]: pinned host memory for the bf16 copies of a window's updated
        # masters, double-buffered, and the event after each one's copies to the device.
        self.copies = [None, None]
        self.copied = [None, None]
        self.stream = None
        self.fence = None
        self.unavailable = False  # the library answered that it never steps on this driver
        self.stepped: list = []
        self.written = None  # the event after the last copies into working copies
        # Note [The host step finishes behind the forward]: the run still on the CPUs, and the
        # pinned memory that holds every gradient of such a run.
        self.behind: "Behind | None" = None
        self.gradients = None
        # host_s: the CPUs' windows, from each one's gradients on the host to its copies
        # queued; of it, host_call_s inside the library's calls, host_copy_wait_s waiting
        # for a pinned buffer's last copies and host_write_s queueing the copies back.
        # host_gradient_wait_s: waiting for a window's gradients, before host_s;
        # host_queue_s: queueing the gradients' copies (by the step's thread when queued
        # ahead); host_prepare_s: the calls prepared ahead (Note [Windows prepared ahead]).
        # host_run_s: each run's wall time, start to end. host_calls: the library calls
        # made (a window's groups', pieces' and step counts', Note [The CPUs' windows]).
        self.figures = {"host_windows": 0, "host_bytes": 0, "host_s": 0.0,
                        "host_call_s": 0.0, "host_copy_wait_s": 0.0, "host_write_s": 0.0,
                        "host_gradient_wait_s": 0.0, "host_queue_s": 0.0, "host_run_s": 0.0,
                        "host_prepare_s": 0.0,
                        "host_pinned_ahead_bytes": 0, "host_pinned_wait_s": 0.0,
                        "host_guarded_steps": 0,
                        "host_refused": 0, "host_copy_bytes": 0, "host_behind_steps": 0,
                        "host_behind_s": 0.0, "host_completed_bytes": 0,
                        "host_returned_bytes": 0, "host_made_state_bytes": 0,
                        "host_state_room_short_bytes": 0, "host_placed_bytes": 0,
                        "host_pieces": 0,
                        "host_calls": 0}
        # Note [Whole masters on the host]: off once the host tier refused a move; with
        # last_on_host (the default) the last masters go to the host (else each partial one
        # goes there whole, where it is).
        self.completing = True
        self.last_on_host = True
        self.returned: set = set()  # ids of the masters the trade brought back
        self.window_parameters = HOST_WINDOW_PARAMETERS  # Note [The CPUs' windows]
        self.piece_parameters = HOST_PIECE_PARAMETERS  # Note [The run's ends in pieces]
        self.queue_ahead = QUEUE_GRADIENTS_AHEAD  # Note [Gradients queued ahead]
        self.ahead_bytes = host_memory_bytes() // 8  # the most its buffer holds
        self.prepare_ahead = PREPARE_WINDOWS_AHEAD  # Note [Windows prepared ahead]
        # Note [Pinned buffers made ahead]: asked for, the thread making them (once), and
        # the stream the copies through them run on, for their release.
        self.pin_ahead = PIN_BUFFERS_AHEAD
        # Note [States made where the CPUs step them], Note [The first step's room]
        self.make_states_on_host = MAKE_STATES_ON_HOST
        self.room_first = ROOM_FIRST
        self.peak_before = None  # the device's peak as the first forward began
        self.headroom_bytes = None  # the engine's prefetch headroom; None: the setting's
        # Note [Behind the forward, guarded]
        self.guard_behind = GUARD_BEHIND or _settings.host_step_guarded()
        watch_captures()
        self.asked_ahead = False
        self.making: "PinnedAhead | None" = None
        self.released_after = [0]

    def make_ahead(self, stepper) -> None:
        """Note [Pinned buffers made ahead]: starts making, once, the pinned buffers the CPUs'
        runs of masters need: one for every master's bf16 gradient (within ahead_bytes, and
        only when the copies are queued ahead) and two for a merged window's bf16 masters."""
        if self.asked_ahead or not self.pin_ahead or stepper.masters is None:
            return
        self.asked_ahead = True
        masters = all_masters(stepper)
        if not masters or not masters[0].is_cuda:
            return
        device = masters[0].device.index
        limit = _stats.raw_stats(device).get("limit_bytes", 0)
        if not limit or 16 * sum(p.numel() for p in masters) <= limit:
            return  # the device may hold them all: the step makes what it needs
        sizes = self.buffer_sizes(masters, behind=False)
        if not self.window_parameters:  # each window alone: its size is the step's to learn
            sizes.pop("copies")
        self.making = PinnedAhead(device, sizes, self.released_after)

    def buffer_sizes(self, masters: list, behind: bool) -> dict:
        """The bytes of the host step's pinned buffers for runs of `masters`. "gradients":
        one for every bf16 gradient, when the copies are queued ahead within ahead_bytes or
        when the run may finish behind the forward (start() queues them all then). "copies":
        each of the two for a window's bf16 masters, aligned each; a merged window holds at
        most window_parameters (without merging, every master bounds it)."""
        count = sum(p.numel() for p in masters)
        total = sum(aligned(p.numel() * 2) for p in masters)
        sizes = {"copies": min(total, 2 * self.window_parameters + 64 * len(masters))
                 if self.window_parameters else total}
        if behind or self.queue_ahead and 2 * count <= self.ahead_bytes:
            sizes["gradients"] = total
        return sizes

    def take_made(self) -> None:
        """Note [Pinned buffers made ahead]: the buffers made ahead, waited for once, take the
        place of any smaller one."""
        making = self.making
        if making is None or making.taken:
            return
        waited = time.perf_counter()
        made = making.take()
        self.figures["host_pinned_wait_s"] += time.perf_counter() - waited
        gradients = made.get("gradients")
        if gradients is not None and (self.gradients is None
                                      or self.gradients.numel() < gradients.numel()):
            self.gradients = gradients
            self.figures["host_pinned_ahead_bytes"] += gradients.numel()
        for slot, copies in enumerate(made.get("copies", [])):
            if self.copies[slot] is None or self.copies[slot].numel() < copies.numel():
                self.copies[slot] = copies
                self.figures["host_pinned_ahead_bytes"] += copies.numel()

    def make_states(self, stepper, windows: list, groups: dict, stream) -> None:
        """Note [States made where the CPUs step them]: the moments of the masters in
        `windows` that have none yet, that the CPUs can step, and that are wholly on the
        host, or that the step sends there first (Note [The first step's room]). They are
        made as AdamW makes them and moved to the host, in batches of about
        STATE_BATCH_BYTES."""
        if not self.make_states_on_host or stepper.masters is None:
            return
        state = stepper.optimizer.state
        candidates = []  # the masters the CPUs could step once wholly on the host
        for window in windows:
            for parameter in window:
                group = groups.get(id(parameter))
                if (state.get(parameter) or group is None
                        or working_of(stepper, parameter) is None
                        or adamw_settings(stepper.optimizer, group) is None
                        or not self.gradient_steppable(stepper, parameter)):
                    continue
                candidates.append(parameter)
        if not candidates:
            return
        places = {id(p): residency_or_foreign(p) for p in candidates}
        # Note [The first step's room]: in the optimizer's first step only. A master added
        # later would be traded back at once (Note [Whole masters on the host]).
        first = self.room_first and not any(state.get(m) for m in all_masters(stepper))
        placed = self.beyond_the_limit(candidates, places) if first else []
        if not placed and not any(places[id(p)] in ON_HOST for p in candidates):
            return
        if not self.room_for_buffers(stepper, candidates[0].device.index):
            return
        if placed:
            self.place_on_host(placed, places)
            # A chunk shared with a master sent may have taken part of a neighbour along:
            # that one stays so, bounced, as a master the trade dragged does.
            sent = {id(p) for p in placed}
            for parameter in candidates:
                if id(parameter) not in sent and places[id(parameter)] == "device":
                    places[id(parameter)] = residency_or_foreign(parameter)
                    if places[id(parameter)] in PARTLY_ON_HOST:
                        self.returned.add(id(parameter))
        chosen = [p for p in candidates if places[id(p)] in ON_HOST]
        if not chosen:
            return
        # AdamW's first step would add these entries in param_groups' order.
        for group in stepper.optimizer.param_groups:
            for parameter in group["params"]:
                if stepper.gradient(parameter) is not None and parameter not in state:
                    state[parameter] = {}
        batches, batch_bytes = [[]], 0
        for parameter in chosen:
            cost = 2 * parameter.untyped_storage().nbytes()
            if batches[-1] and batch_bytes + cost > STATE_BATCH_BYTES:
                batches.append([])
                batch_bytes = 0
            batches[-1].append(parameter)
            batch_bytes += cost
        try:
            for batch in batches:
                if batch:
                    self.make_batch(stepper, batch, stream)
        except (ZeroallocError, RuntimeError) as error:
            # The host tier is full, or the device has no room for a batch: AdamW makes the
            # rest, as without this.
            if not isinstance(error, ZeroallocError) and not is_out_of_memory(error):
                raise
            self.make_states_on_host = False
            warnings.warn(f"zeroalloc: making new optimizer states on the host failed "
                          f"({error}); the optimizer makes the rest on the device")
        finally:
            stepper.forget(chosen)

    def beyond_the_limit(self, candidates: list, places: dict) -> list:
        """Note [The first step's room]: the last of `candidates` (masters without states, in
        the order the CPUs step them) on the device, or split, that must go to the host,
        whole, for their moments and the rest of the step's peak to fit under the device's
        limit; none when they fit, or when the peak is not this step's own."""
        if not candidates[0].is_cuda:
            return []
        stats = _stats.raw_stats(candidates[0].device.index)
        limit = stats.get("limit_bytes", 0)  # the device's memory when no limit was set
        peak = stats["total"]["allocated_bytes"]["peak"]
        if not limit or self.peak_before is None or peak <= self.peak_before:
            return []  # the peak may be another phase's (a checkpoint loaded, an evaluation)
        # AdamW makes two moments shaped as each master; those of masters on the host are
        # made there (make_states).
        new = sum(2 * p.untyped_storage().nbytes() for p in candidates
                  if places[id(p)] not in ON_HOST)
        # The engine keeps its prefetch headroom free below the limit (as plan_host counts).
        headroom = (self.headroom_bytes if self.headroom_bytes is not None
                    else _settings.prefetch_headroom_bytes())
        over = peak + new + headroom - limit
        chosen, saved = [], 0
        for parameter in reversed(candidates):
            if saved >= over:
                break
            if places[id(parameter)] in ("device", "split"):  # the masters the trade takes
                chosen.append(parameter)
                saved += 3 * parameter.untyped_storage().nbytes()  # the master, its moments
        return chosen[::-1]

    def note_peak(self, stepper) -> None:
        """Note [The first step's room]: the device's peak allocation as the first forward
        after offload() begins. The first step's estimate takes only a peak above it: one
        its own forward and backward reached."""
        masters = all_masters(stepper) if stepper.masters is not None else []
        if self.room_first and masters and masters[0].is_cuda:
            stats = _stats.raw_stats(masters[0].device.index)
            self.peak_before = stats["total"]["allocated_bytes"]["peak"]

    def place_on_host(self, masters: list, places: dict) -> None:
        """Note [The first step's room]: moves `masters` to the host (all queued, then waited
        for), and asks their residency again into `places`. A move the host tier refuses
        warns, and the masters not moved stay where they are (AdamW makes their moments)."""
        try:
            move_together(_offload.offload_pointer, masters)
        except ZeroallocError as error:
            warnings.warn(f"zeroalloc: moving masters to the host for their first states "
                          f"failed ({error}); the optimizer makes their states on the device")
        for master in masters:
            places[id(master)] = residency_or_foreign(master)
            if places[id(master)] in ON_HOST:
                self.figures["host_placed_bytes"] += master.untyped_storage().nbytes()

    def room_for_buffers(self, stepper, device: int) -> bool:
        """Note [States made where the CPUs step them]: whether the host can pin the host
        step's buffers now and still leave what its host tier may create up to its limit,
        and the tier's reserve of a sixteenth of the host. PyTorch's pinned allocator rounds
        each buffer up to a power of two. A buffer held already, made ahead by the library
        (Note [Pinned buffers made ahead]) or by an earlier step, needs nothing more. When
        there is no room, the log and the report are told once what is missing and which
        limit leaves it."""
        room = self.buffer_room(stepper, device)
        if room.short == 0:
            return True
        told = self.figures["host_state_room_short_bytes"] > 0
        self.figures["host_state_room_short_bytes"] = room.short
        if not told:
            try:
                _offload.log("warn", room_message(room))
                # The report (ZEROALLOC_REPORT) keeps it for doctor; none asked: nothing.
                library().zeroalloc_report_section(b"host_step",
                                                   json.dumps(room_section(room)).encode())
            except ZeroallocError:
                pass
        return False

    def buffer_room(self, stepper, device: int) -> "BufferRoom":
        """The host's room for the host step's buffers (room_for_buffers), asked now."""
        self.take_made()  # the buffers made ahead, if asked for: waited for once
        behind = getattr(stepper, "behind_allowed", False) or self.guard_behind
        sizes = self.buffer_sizes(all_masters(stepper), behind)
        need = sum(power_of_two(sizes["copies"]) for copies in self.copies
                   if copies is None or copies.numel() < sizes["copies"])
        gradients = sizes.get("gradients", 0)
        if gradients and (self.gradients is None or self.gradients.numel() < gradients):
            need += power_of_two(gradients)
        offload = _stats.raw_stats(device).get("offload") or {}
        return BufferRoom(need=need, available=available_host_bytes(),
                          limit=offload.get("host_limit_bytes", 0),
                          created=offload.get("host_created_bytes", 0),
                          reserve=host_memory_bytes() // 16)

    def make_batch(self, stepper, parameters: list, stream) -> None:
        """Makes the moments of `parameters` in the optimizer-state class, zeroes them on
        `stream` (their first touch, hinted, as move_into_class's copy is) and moves them to
        the host."""
        made = []
        with _stats.allocation_class("optimizer_state"):
            for parameter in parameters:
                made.append((torch.empty_like(parameter, memory_format=torch.preserve_format),
                             torch.empty_like(parameter, memory_format=torch.preserve_format)))
        moments = [moment for pair in made for moment in pair]
        _use_hints.hint(_offload.use_in_place_many, moments, stream.cuda_stream)
        try:
            with torch.cuda.stream(stream):
                torch._foreach_zero_(moments)
        finally:
            _use_hints.hint(_offload.use_ends_many, moments, stream.cuda_stream)
        state = stepper.optimizer.state
        for parameter, (exp_avg, exp_avg_sq) in zip(parameters, made):
            state[parameter].update({"step": step_count_zero(), "exp_avg": exp_avg,
                                     "exp_avg_sq": exp_avg_sq})
        move_together(_offload.offload_pointer, moments)
        self.figures["host_made_state_bytes"] += sum(m.untyped_storage().nbytes()
                                                     for m in moments)

    def merged(self, chosen: list) -> list:
        """Note [The CPUs' windows]: `chosen` ((window number, its parameters on the host), in
        order) with windows of consecutive numbers merged up to window_parameters parameters
        each (the first one's number; 0: none merged); a window larger than that stays alone.
        Windows the device steps between two are not jumped over: a forward behind the CPUs
        would wait at the first for the second."""
        turns, counted, last = [], 0, None
        for number, hosted in chosen:
            count = sum(p.numel() for p in hosted)
            if (turns and self.window_parameters and number == last + 1
                    and counted + count <= self.window_parameters):
                turns[-1] = (turns[-1][0], turns[-1][1] + list(hosted))
                counted += count
            else:
                turns.append((number, list(hosted)))
                counted = count
            last = number
        return turns

    def eligible(self, stepper, parameter, places: dict, groups: dict) -> bool:
        """Whether the parameter can be stepped on the host: AdamW settings it runs, fp32
        whole tensors, states created, and the parameter and its states on the host (as
        `places` says, or asked now)."""
        tensors = self.steppable(stepper, parameter, groups)
        return tensors is not None and all(place_of(t, places) in ON_HOST for t in tensors)

    def steppable(self, stepper, parameter, groups: dict) -> "tuple | None":
        """The parameter and its two moments when the CPUs can step them (AdamW settings
        they run, fp32 whole tensors, states created), wherever they are; else None."""
        group = groups.get(id(parameter))
        if group is None or adamw_settings(stepper.optimizer, group) is None:
            return None
        state = stepper.optimizer.state.get(parameter, {})
        if ("exp_avg" not in state or "exp_avg_sq" not in state or "step" not in state
                or not self.gradient_steppable(stepper, parameter)):
            return None
        tensors = (parameter, state["exp_avg"], state["exp_avg_sq"])
        if not all(whole_fp32(t) for t in tensors[1:]):
            return None
        return tensors

    def gradient_steppable(self, stepper, parameter) -> bool:
        """Whether the CPUs can step `parameter` once it has moments: an fp32 whole tensor
        with a whole gradient on the device, fp32, or bf16 for a master, whose bf16 working
        copy on the device takes the result."""
        grad = stepper.gradient(parameter)
        if grad is None or not grad.is_cuda or not whole_fp32(parameter):
            return False
        working = working_of(stepper, parameter)
        if working is None:
            return whole_fp32(grad)
        return (whole(grad, torch.bfloat16) and working.dtype == torch.bfloat16
                and working.is_contiguous() and working.is_cuda)

    def whole_on_host(self, stepper, windows: list, places: dict, groups: dict) -> None:
        """Note [Whole masters on the host]: what the host holds of masters is traded for the
        last masters, whole, and the rest comes back (without `last_on_host`, each master
        the host holds a part of goes there whole instead): trade(). `places` holds the
        residency asked of the windows' masters and states; it is updated."""
        if not self.completing or stepper.masters is None:
            return
        masters = []  # (tensors, their places), in the order the CPUs step them
        for window in windows:
            for parameter in window:
                if working_of(stepper, parameter) is None:
                    continue  # not a master: the model's own weight, which the forward uses
                tensors = self.steppable(stepper, parameter, groups)
                if tensors is None:
                    continue
                found = [place_of(tensor, places) for tensor in tensors]
                # One on disk or moving is left where it is, as is a foreign tensor.
                if all(place in PARTLY_ON_HOST or place == "device" for place in found):
                    masters.append((tensors, found))
        to_host, to_device = self.trade(masters)
        if not to_host and not to_device:
            return
        try:
            # Out first: what leaves makes the room for what comes back.
            move_together(_offload.offload_pointer, to_host)
            move_together(_offload.fetch_pointer, to_device)
        except ZeroallocError as error:  # the host tier is full, say: bounced as before
            self.completing = False
            warnings.warn(f"zeroalloc: moving masters whole to the host or back failed "
                          f"({error}); masters partly on the host step on the device from "
                          "now on")
        # A chunk may hold bytes of two masters: a move can take a part of one it did not
        # name along (asked again, such a master steps on the device, bounced, not refused).
        # With the trade, such a master stays so, as one brought back does: counted in the
        # next step's bytes, it would be traded for one more last master whole, whose move
        # drags the next neighbour along, and the line would creep a master a step.
        moved = {id(tensor) for tensor in to_host}
        for tensors, found in masters:
            for tensor in tensors:
                places[id(tensor)] = residency_or_foreign(tensor)
            dragged = (self.last_on_host and not any(id(t) in moved for t in tensors)
                       and not any(place in PARTLY_ON_HOST for place in found)
                       and any(places[id(t)] in PARTLY_ON_HOST for t in tensors))
            if dragged:
                self.returned.add(id(tensors[0]))
        self.figures["host_completed_bytes"] += sum(t.untyped_storage().nbytes()
                                                    for t in to_host)
        self.figures["host_returned_bytes"] += sum(t.untyped_storage().nbytes()
                                                   for t in to_device)

    def trade(self, masters: list) -> tuple:
        """Note [Whole masters on the host]: (tensors to move to the host, tensors to bring
        back) so that the last of `masters` ((tensors, places) each, in order) are on the
        host whole, the fewest that hold as many bytes as the host holds of masters, and the
        others on the device. With `last_on_host` off, each master the host holds a part of goes
        there whole instead, and none comes back."""
        def size(tensors) -> int:
            return sum(t.untyped_storage().nbytes() for t in tensors)

        def held(tensors, found) -> int:  # what the host holds of them: half of a split one
            return sum(t.untyped_storage().nbytes() // (1 if place in ON_HOST else 2)
                       for t, place in zip(tensors, found) if place in PARTLY_ON_HOST)

        partly = [any(place in PARTLY_ON_HOST for place in found) for _, found in masters]
        if self.last_on_host:
            # A master brought back once and partly on the host again (a chunk it shares
            # with a master moved out) stays so, bounced: trading it again would move the
            # line one master down every step.
            again = [part and id(tensors[0]) in self.returned
                     for (tensors, _), part in zip(masters, partly)]
            # As many bytes as the engine left on the host, not the whole masters they are
            # parts of: the CPUs' time grows with every byte there (Note [Whole masters on
            # the host]).
            target = sum(held(tensors, found)
                         for (tensors, found), part, old in zip(masters, partly, again)
                         if part and not old)
            chosen, total = [False] * len(masters), 0
            for number in reversed(range(len(masters))):
                if total >= target:
                    break
                chosen[number] = True
                total += size(masters[number][0])
        else:
            chosen, again = partly, [False] * len(masters)
        to_host, to_device = [], []
        for (tensors, found), there, part, old in zip(masters, chosen, partly, again):
            if there:
                to_host += [t for t, place in zip(tensors, found) if place not in ON_HOST]
            elif part and not old:
                to_device += [t for t, place in zip(tensors, found) if place != "device"]
                self.returned.add(id(tensors[0]))
        return to_host, to_device

    def copy_gradients(self, stepper, window, slot: int, after) -> tuple:
        """Starts copying the window's gradients into pinned buffer `slot`, after the event
        `after` (the backward's end); returns (what the CPUs read for each: a view of the
        buffer, or the gradient itself when it is on the host, event after the copies)."""
        grads = [stepper.gradient(p) for p in window]
        # A gradient the engine moved to the host (zt.offload's gradient_class) is read
        # there; the others are copied (a master's bf16 gradient always: the CPUs read
        # those from the caller's memory only).
        there = {id(p) for p, g in zip(window, grads)
                 if working_of(stepper, p) is None and residency_or_foreign(g) == "host"}
        total = sum(aligned(g.numel() * g.element_size()) for p, g in zip(window, grads)
                    if id(p) not in there)
        buffer = self.buffers[slot]
        if total and (buffer is None or buffer.numel() < total):
            buffer = self.buffers[slot] = pinned_buffer(total)
        views, offset = [], 0
        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            for parameter, grad in zip(window, grads):
                if id(parameter) in there:
                    views.append(grad)
                    continue
                nbytes = grad.numel() * grad.element_size()
                view = buffer[offset:offset + nbytes].view(grad.dtype)
                grad.record_stream(self.stream)  # before the copy is queued
                view.copy_(grad.view(-1), non_blocking=True)
                views.append(view)
                offset += aligned(nbytes)
        copied = torch.cuda.Event()
        copied.record(self.stream)
        return views, copied

    def queues_ahead(self, stepper, chosen: list) -> bool:
        """Note [Gradients queued ahead]: whether the run over `chosen` queues every
        gradient's copy before the CPUs' thread starts: every parameter a master (bf16
        gradients, 2 bytes a parameter) and the buffer within its budget."""
        parameters = [p for _, hosted in chosen for p in hosted]
        return (self.queue_ahead
                and all(working_of(stepper, p) is not None for p in parameters)
                and 2 * sum(p.numel() for p in parameters) <= self.ahead_bytes)

    def copy_every_gradient(self, stepper, chosen: list, after, cuts: dict) -> tuple:
        """Note [Gradients queued ahead] and Note [The host step finishes behind the
        forward]: queues the copies of every window's gradients into one pinned buffer,
        after the event `after`; returns, per window number, (views of the buffer, event
        after its copies), and, per window number in `cuts` (the ends of its pieces, Note
        [The run's ends in pieces]), the pieces as (end, event after its copies)."""
        grads = {number: [stepper.gradient(p) for p in hosted] for number, hosted in chosen}
        total = sum(aligned(g.numel() * g.element_size()) for each in grads.values()
                    for g in each)
        if self.gradients is None or self.gradients.numel() < total:
            self.gradients = None  # the old one goes first
            self.gradients = pinned_buffer(total)
        copies, pieces, offset = {}, {}, 0
        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            for number, _ in chosen:
                views = []
                ends = set(cuts.get(number, [])[:-1])  # those before the window's end
                marks = []
                for index, grad in enumerate(grads[number]):
                    nbytes = grad.numel() * grad.element_size()
                    view = self.gradients[offset:offset + nbytes].view(grad.dtype)
                    grad.record_stream(self.stream)  # before the copy is queued
                    view.copy_(grad.view(-1), non_blocking=True)
                    views.append(view)
                    offset += aligned(nbytes)
                    if index + 1 in ends:
                        mark = torch.cuda.Event()
                        mark.record(self.stream)
                        marks.append((index + 1, mark))
                copied = torch.cuda.Event()
                copied.record(self.stream)
                copies[number] = (views, copied)
                if marks:
                    pieces[number] = marks + [(len(views), copied)]
        return copies, pieces

    def start(self, stepper, chosen: list, groups: dict, main,
              behind: bool = False) -> "HostRun":
        """Steps `chosen` ((window number, its parameters on the host), in order) on a thread
        of its own, while the caller steps the rest of the windows on the device: each
        window's gradients' copies are queued here, all at once (Note [Gradients queued
        ahead], and always when the run may finish `behind` the forward: Note [The host
        step finishes behind the forward]), else by the thread while the CPUs step the
        window before."""
        began = time.perf_counter()
        device = main.device
        if self.stream is None or self.stream.device != device:
            if self.stream is not None:  # the pinned buffers' copies ran there: done first
                self.stream.synchronize()
            self.stream = torch.cuda.Stream(device)
            self.released_after[0] = self.stream.cuda_stream  # the pinned buffers' copies
            # What the library waits for before the CPUs read (the backward's end), apart
            # from the copies: waiting for the copy stream would wait for the next window's.
            self.fence = torch.cuda.Stream(device)
        self.take_made()  # Note [Pinned buffers made ahead]
        after = torch.cuda.Event()
        after.record(main)  # the backward's end: the copies need nothing main queues later
        self.fence.wait_event(after)
        run = HostRun()
        # The optimizer lives while its windows are on the CPUs: the step holds it only weakly,
        # and a script that drops it right after its last step (or ends) still gets that
        # step's values in its model (finish_every_behind, at exit too).
        run.optimizer = stepper.optimizer
        # The settings as they are now: a scheduler may change them before the CPUs are done.
        settings = {id(group): adamw_settings(stepper.optimizer, group)
                    for group in {id(g): g for g in groups.values()}.values()}
        every = None
        pieces: dict = {}  # Note [The run's ends in pieces]: per window, (end, event) each
        if behind or self.queues_ahead(stepper, chosen):  # Note [Gradients queued ahead]
            queueing = time.perf_counter()
            cuts = {number: piece_ends([p.numel() for p in hosted], turn == 0,
                                       turn + 1 == len(chosen), self.piece_parameters)
                    for turn, (number, hosted) in
                    enumerate(chosen if self.piece_parameters else ())}
            every, pieces = self.copy_every_gradient(stepper, chosen, after, cuts)
            self.figures["host_queue_s"] += time.perf_counter() - queueing
        plans = {}
        # Note [Windows prepared ahead]. A window in pieces plans each piece once its
        # gradients are there (Note [The run's ends in pieces]).
        if every is not None and self.prepare_ahead:
            preparing = time.perf_counter()
            plans = {number: self.plan(stepper, hosted, every[number][0], groups, settings,
                                       turn % 2, ahead=True)
                     for turn, (number, hosted) in enumerate(chosen) if number not in pieces}
            self.figures["host_prepare_s"] += time.perf_counter() - preparing
        if every:
            run.gradients_copied = every[chosen[-1][0]][1]  # the last window's, on one stream
        # Behind the forward, each master's gradient on the host, for a call refused or never
        # made (stepped on the device later from it).
        kept = {}
        for number, hosted in chosen if behind else ():
            views, copied = every[number]
            kept.update((id(p), (view, copied)) for p, view in zip(hosted, views))

        def keep(parameters) -> None:
            for parameter in parameters:
                view, copied = kept[id(parameter)]
                copied.synchronize()
                run.saved[id(parameter)] = view.clone()

        def work() -> None:
            try:
                with torch.cuda.device(device):
                    copies: dict = {}
                    for turn, (number, hosted) in enumerate(chosen):
                        queueing = time.perf_counter()
                        if every is not None:
                            copies[number] = every.pop(number)
                        else:
                            if turn == 0:
                                copies[number] = self.copy_gradients(stepper, hosted, 0, after)
                            if turn + 1 < len(chosen):  # the next one's, while the CPUs work
                                following, its_hosted = chosen[turn + 1]
                                copies[following] = self.copy_gradients(
                                    stepper, its_hosted, (turn + 1) % 2, after)
                        self.figures["host_queue_s"] += time.perf_counter() - queueing
                        run.done = turn
                        views = copies.pop(number)
                        refused = self.step(stepper, hosted, views, groups, settings,
                                            turn % 2, plans.pop(number, None),
                                            pieces.pop(number, None))
                        with run.changed:
                            if refused:
                                if behind:
                                    keep(refused)
                                run.refused.append(refused)
                            run.written.append(self.written)
                            run.done = turn + 1
                            run.changed.notify_all()
            except BaseException as error:  # noqa: BLE001  raised by the caller after
                if isinstance(error, _offload.HostStepUnavailable):
                    # Never on this driver: the rest steps on the device, now and after.
                    warnings.warn(f"zeroalloc: {error}")
                    self.unavailable = True
                else:
                    run.error = error
                # What no call stepped goes to the device: the window being stepped less
                # what its finished calls stepped, and the windows after it.
                with run.changed:
                    if run.done < len(chosen):
                        stepped = {id(p) for p in self.stepped}
                        current = [p for p in chosen[run.done][1] if id(p) not in stepped]
                        left = [part for part in [current] + [h for _, h in chosen[run.done + 1:]]
                                if part]
                        try:
                            for part in left if behind else ():
                                keep(part)
                        except BaseException as failure:  # noqa: BLE001
                            run.error = run.error or failure
                        run.refused.extend(left)
            finally:
                self.figures["host_run_s"] += time.perf_counter() - began
                held = None
                with run.changed:
                    run.finished = True
                    if not run.refused and run.error is None:
                        held, run.optimizer = run.optimizer, None  # nothing steps with it now
                    run.changed.notify_all()
                # Outside the lock: the last reference may free the optimizer's states here,
                # which no waiter should wait for.
                del held

        run.thread = threading.Thread(target=work, name="zeroalloc-host-step", daemon=True)
        run.thread.start()
        return run

    def plan(self, stepper, window, views: list, groups: dict, settings: dict,
             slot: int, ahead: bool = False, offset: "list | None" = None) -> list:
        """The window's library calls: one per group, step count (the bias corrections
        differ between counts) and kind (masters or not), each with its arguments; `ahead`
        (Note [Windows prepared ahead]): with each master's working copy flattened for the
        copy back. The calls lay their masters' copies out one after the other in pinned
        buffer `slot`, from `offset` ([bytes], moved past them; a piece's, Note [The run's
        ends in pieces]) or from its start (Note [The CPUs' windows])."""
        if offset is None:
            offset = [0]
            self.reserve_copies(stepper, window, slot)
        batches: dict = {}
        for parameter, view in zip(window, views):
            group = groups[id(parameter)]
            state = stepper.optimizer.state[parameter]
            count = int(state["step"].item() if torch.is_tensor(state["step"])
                        else state["step"]) + 1
            master = working_of(stepper, parameter) is not None
            batches.setdefault((id(group), count, master), (group, []))[1].append(
                (parameter, view))
        planned = []
        for (_, count, master), (group, members) in batches.items():
            states = [stepper.optimizer.state[p] for p, _ in members]
            arguments = ([p.untyped_storage().data_ptr() for p, _ in members],
                         [view.data_ptr() for _, view in members],
                         [s["exp_avg"].untyped_storage().data_ptr() for s in states],
                         [s["exp_avg_sq"].untyped_storage().data_ptr() for s in states])
            outputs = self.output_views(members, slot, offset) if master else None
            if master:
                arguments += ([o.data_ptr() for o in outputs],)
            targets = ([working_of(stepper, p).data.view(-1) for p, _ in members]
                       if master and ahead else None)
            planned.append(HostCall(settings[id(group)], count, master, members, states,
                                    arguments, [p.numel() for p, _ in members], outputs,
                                    targets))
        return planned

    def step(self, stepper, window, gradients: tuple, groups: dict, settings: dict,
             slot: int = 0, planned: "list | None" = None,
             pieces: "list | None" = None) -> list:
        """Steps the window on the CPUs once its gradients are on the host, with the calls
        `planned` (else planned here), each all or nothing; returns the parameters of the
        calls the library refused (a part on the device: nothing of theirs changed). With
        `pieces` ((end, event after its gradients' copies) each, Note [The run's ends in
        pieces]), piece by piece, each planned once its gradients are there."""
        # What this window's finished calls stepped: cleared first, so that a failure from
        # here on hands the whole window to the device (work()).
        self.stepped = []
        views, copied = gradients
        batched = planned is not None  # Note [Windows prepared ahead]
        if pieces is None:
            pieces = [(len(window), copied)]
        refused = []
        # The window's calls (its groups', its pieces') lay their masters out one after the
        # other in the pinned buffer, so the CPUs wait for its last copies once, before the
        # first call: none waits for another's copies back (Note [The CPUs' windows]).
        offset = [0]
        if not batched:
            self.reserve_copies(stepper, window, slot)
        begin = 0
        for end, arrived in pieces:
            waited = time.perf_counter()
            arrived.synchronize()
            started = time.perf_counter()
            self.figures["host_gradient_wait_s"] += started - waited
            try:
                if begin == 0:
                    self.wait_copies(slot)
                if not batched:
                    planned = self.plan(stepper, window[begin:end], views[begin:end], groups,
                                        settings, slot, offset=offset)
                refused += self.run_calls(stepper, planned, slot, batched)
            finally:
                self.figures["host_s"] += time.perf_counter() - started
            begin = end
        self.figures["host_pieces"] += len(pieces) - 1
        if len(refused) < len(window):
            self.figures["host_windows"] += 1
        return refused

    def run_calls(self, stepper, planned: list, slot: int, batched: bool) -> list:
        """Makes the library calls `planned`, queueing each stepped master's copies back;
        returns the parameters of the calls refused. The caller waited for pinned buffer
        `slot`'s last copies once for the window, whose calls lay their masters out at
        offsets of their own."""
        refused = []
        for call in planned:
            members = call.members
            calling = time.perf_counter()
            if call.master:
                stepped = _offload.adamw_on_host_bf16(
                    *call.arguments, call.counts, step=call.count,
                    stream=self.fence.cuda_stream, **call.settings)
            else:
                stepped = _offload.adamw_on_host(*call.arguments, call.counts,
                                                 step=call.count,
                                                 stream=self.fence.cuda_stream,
                                                 **call.settings)
            self.figures["host_call_s"] += time.perf_counter() - calling
            self.figures["host_calls"] += 1
            if not stepped:
                self.figures["host_refused"] += 1
                refused.extend(p for p, _ in members)
                continue
            count_steps(call.states, batched)
            # Stepped, whatever follows: a failure below must not hand them to the device
            # to be stepped again.
            self.stepped.extend(p for p, _ in members)
            self.figures["host_bytes"] += sum(call.counts) * 4
            if call.master:
                writing = time.perf_counter()
                self.write_working(stepper, members, call.outputs, slot, call.targets)
                self.figures["host_write_s"] += time.perf_counter() - writing
        return refused

    def defer(self, behind: "Behind") -> None:
        """Note [The host step finishes behind the forward]: `behind` finishes after the step."""
        self.behind = behind
        self.figures["host_behind_steps"] += 1
        if self not in behind_steps:
            behind_steps.append(self)
        if wait_behind not in _use_hints.before_use:
            _use_hints.before_use.append(wait_behind)

    def forget_behind(self) -> None:
        self.behind = None
        if self in behind_steps:
            behind_steps.remove(self)
        if not behind_steps and wait_behind in _use_hints.before_use:
            _use_hints.before_use.remove(wait_behind)

    def before_use(self, tensors: list, stream: int) -> None:
        """A hinted use of `tensors` on `stream` (0: the current one) waits for the windows of
        the run behind that write them."""
        behind = self.behind
        if behind is None or threading.current_thread() is behind.run.thread:
            return  # the CPUs' own writes into the working copies
        needed = -1
        for tensor in tensors:
            # A guarded parameter by its identity: asking it for its storage is a call the
            # guard would wait in (Note [Behind the forward, guarded]).
            turn = (behind.turn_of.get(id(tensor)) if type(tensor) is GuardedParameter
                    else behind.window_of.get(tensor.untyped_storage().data_ptr()))
            if turn is not None and turn > needed:
                needed = turn
        if needed < 0:
            return
        self.wait_window(behind, needed, stream)

    def wait_window(self, behind: "Behind", needed: int, stream: int) -> None:
        """Waits until the run behind has written window `needed`, and orders `stream` (0:
        the current one) after its copies."""
        stream = stream or torch.cuda.current_stream(behind.device).cuda_stream
        if behind.ordered.get(stream, -1) >= needed:
            return
        waiting = stream_of(stream, behind.device)
        run = behind.run
        started = time.perf_counter()
        with run.changed:
            run.changed.wait_for(lambda: run.done > needed or run.finished)
            failed = run.error is not None or run.done <= needed
            event = run.written[needed] if not failed else None
            refused = bool(run.refused)
        self.figures["host_behind_s"] += time.perf_counter() - started
        if failed:  # what the thread left steps on the device now; its error is raised
            self.finish_behind()
            return
        if event is not None:
            waiting.wait_event(event)
        behind.ordered[stream] = needed
        if refused or behind.stepping:
            self.step_refused(behind)
            if behind.stepping_thread is not threading.current_thread():
                with behind.steps_done:  # another thread steps them: after its steps
                    behind.steps_done.wait_for(lambda: not behind.stepping)
            for event in list(behind.stepped_after):  # the refused parameters' steps, too
                waiting.wait_event(event)
        with run.changed:
            done = run.finished and not run.refused and run.error is None
        if done and needed == behind.turns - 1 and not behind.stepping:
            behind.settle(behind.stepped_after)
            self.forget_behind()  # every window waited for: nothing left to hold

    def finish_behind(self) -> None:
        """Waits for the run behind the forward, orders the current stream after its copies,
        steps what the library refused on the device, and raises the thread's error."""
        unguard_settled()  # a run forgotten while its last copies still ran
        behind = self.behind
        if behind is None:
            return
        self.forget_behind()  # first: the steps below hint uses of the same working copies
        try:
            started = time.perf_counter()
            behind.run.join()
            self.figures["host_behind_s"] += time.perf_counter() - started
            torch.cuda.current_stream(behind.device).wait_stream(self.stream)
            self.step_refused(behind)
        finally:
            if not behind.run.finished:  # interrupted: the thread's end settles it
                behind.run.join()
            behind.settle(behind.stepped_after)
            if behind.guarded:  # every copy and step of the run done, on every stream
                for event in behind.final_events:
                    event.synchronize()
                unguard(behind)
        behind.run.optimizer = None  # what the run left is stepped: it needs it no more
        if behind.run.error is not None:
            raise behind.run.error

    def guard_wait(self, behind: "Behind", tensor) -> None:
        """Note [Behind the forward, guarded]: a call on the current stream takes `tensor`, a
        working copy of `behind`. It waits for the tensor's window while the run is behind;
        once the run is settled, the stream is ordered after all of it (once), and the
        working copies are plain again when its copies are done."""
        current = threading.current_thread()
        if current is behind.run.thread or current is behind.stepping_thread:
            return  # the run's own writes, or the refused parameters' steps
        if self.behind is behind:
            self.wait_window(behind, behind.turn_of[id(tensor)], 0)
            if self.behind is behind:
                return
        behind.settled.wait()  # finish_behind, or the last window waited for, settles it
        stream = torch.cuda.current_stream(behind.device)
        if stream.cuda_stream not in behind.finally_ordered:
            for event in behind.final_events:
                stream.wait_event(event)
            behind.finally_ordered.add(stream.cuda_stream)
        if behind.guarded and all(event.query() for event in behind.final_events):
            unguard(behind)

    def step_refused(self, behind: "Behind") -> None:
        """The parameters of refused calls (or left by a failure) so far, stepped on the device
        from the gradients the run kept on the host."""
        with behind.steps_done:
            if behind.stepping:  # a use the steps below hint, or another thread's steps
                return
            behind.stepping = True
            behind.stepping_thread = threading.current_thread()
        try:
            while True:
                with behind.run.changed:
                    if not behind.run.refused:
                        return
                    parameters = behind.run.refused.pop(0)
                try:
                    behind.stepper.step_behind(behind, parameters)
                    if behind.guarded:  # other streams order after these writes too
                        stepped = torch.cuda.Event()
                        stepped.record(torch.cuda.current_stream(behind.device))
                        behind.stepped_after.append(stepped)
                except BaseException:
                    with behind.run.changed:  # not stepped: still to do
                        behind.run.refused.insert(0, parameters)
                    raise
        finally:
            with behind.steps_done:
                behind.stepping = False
                behind.stepping_thread = None
                behind.steps_done.notify_all()

    def wait_copies(self, slot: int) -> None:
        """Waits for pinned buffer `slot`'s last copies to the device: the CPUs write it."""
        if self.copied[slot] is not None:
            waited = time.perf_counter()
            self.copied[slot].synchronize()
            self.figures["host_copy_wait_s"] += time.perf_counter() - waited
            self.copied[slot] = None

    def output_views(self, members: list, slot: int, at: "list | None" = None) -> list:
        """Views of pinned buffer `slot` for the bf16 copies of `members`' masters (written
        only once wait_copies(slot) returned), from `at` ([bytes], moved past them). A
        buffer replaced by a larger one lives on in the views and copies that still use
        it."""
        offset = at[0]
        buffer = self.grow_copies(slot, offset + sum(aligned(p.numel() * 2) for p, _ in members))
        views = []
        for parameter, _ in members:
            nbytes = parameter.numel() * 2
            views.append(buffer[offset:offset + nbytes].view(torch.bfloat16))
            offset += aligned(nbytes)
        at[0] = offset
        return views

    def reserve_copies(self, stepper, window: list, slot: int) -> None:
        """Grows pinned buffer `slot` to hold the bf16 copies of every master of `window` at
        once, before its calls lay theirs out: grown call by call, each larger buffer would
        leave the last one in PyTorch's pinned cache."""
        total = sum(aligned(p.numel() * 2) for p in window
                    if working_of(stepper, p) is not None)
        if total:
            self.grow_copies(slot, total)

    def grow_copies(self, slot: int, nbytes: int) -> torch.Tensor:
        """Pinned buffer `slot`, replaced by one of `nbytes` when it holds fewer."""
        buffer = self.copies[slot]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self.copies[slot] = pinned_buffer(nbytes)
        return buffer

    def write_working(self, stepper, members: list, outputs: list, slot: int,
                      targets: "list | None" = None) -> None:
        """Queues the copies of the updated masters' bf16 values into their working copies
        on the copy stream (each a use of the working copy); the step's stream waits for
        that stream after the host's windows. With `targets` (the working copies flattened,
        Note [Windows prepared ahead]), in one PyTorch call."""
        workings = [working_of(stepper, p) for p, _ in members]
        # Held: a step boundary on the main thread must not close it while the copies are
        # queued (Note [A use the boundary waits for] in zeroalloc/_offload.py).
        with _offload.use_held(_use_hints.pointers(workings), self.stream.cuda_stream):
            try:
                with torch.cuda.stream(self.stream):
                    if targets is not None:
                        torch._foreach_copy_(targets, outputs, non_blocking=True)
                    else:
                        for working, output in zip(workings, outputs):
                            working.data.view(-1).copy_(output, non_blocking=True)
            finally:
                # After whatever was queued, even if queueing failed part way: the CPUs
                # write this buffer again only once these copies have read it.
                done = torch.cuda.Event()
                done.record(self.stream)
                self.copied[slot] = done
                self.written = done
        self.figures["host_copy_bytes"] += sum(p.numel() * 2 for p, _ in members)


class PinnedAhead:
    """Note [Pinned buffers made ahead]: the library's pinned buffers of `sizes` ("gradients":
    one of that many bytes; "copies": two), made on a thread of their own for `device`, as
    CPU tensors. They are released when the last of this object's tensors is gone, once the
    work queued on the stream `released_after[0]` names is done (their copies run there)."""

    def __init__(self, device: int, sizes: dict, released_after: list):
        self.made: dict = {}
        self.taken = False
        # Not a daemon: the process's end waits for it, not the driver's teardown.
        self.thread = threading.Thread(target=self.make, args=(device, sizes, released_after),
                                       name="zeroalloc-pinned-buffers")
        self.thread.start()

    def make(self, device: int, sizes: dict, released_after: list) -> None:
        try:
            if "gradients" in sizes:
                self.made["gradients"] = pinned_tensor(device, sizes["gradients"],
                                                       released_after)
            if "copies" in sizes:
                self.made["copies"] = [pinned_tensor(device, sizes["copies"], released_after)
                                       for _ in range(2)]
        except ZeroallocError as error:  # the host cannot spare it: the step makes its own
            try:
                _offload.log("info", f"zeroalloc: the host step's pinned buffers were not made "
                                     f"ahead ({error}); the step makes them when it needs them")
            except ZeroallocError:
                pass

    def take(self) -> dict:
        """The buffers made (those that could be), once the thread is done."""
        self.thread.join()
        self.taken = True
        made, self.made = self.made, {}
        return made


def pinned_tensor(device: int, nbytes: int, released_after: list):
    """A uint8 CPU tensor of `nbytes` over a pinned buffer the library made for `device`
    (Note [Pinned buffers made ahead]); the buffer goes back once no tensor uses it, after the
    work queued on the stream released_after[0] names (0 until the step has one)."""
    address = _offload.pinned_create(device, nbytes)
    array = (ctypes.c_uint8 * nbytes).from_address(address)
    release = weakref.finalize(array, release_pinned, address, released_after)
    release.atexit = False  # the process's end gives the memory back
    return torch.frombuffer(array, dtype=torch.uint8)


def release_pinned(address: int, released_after: list) -> None:
    try:
        _offload.pinned_release(address, released_after[0])
    except ZeroallocError as error:  # called by the collector: never raise
        warnings.warn(f"zeroalloc: releasing a pinned buffer of the host step failed: {error}")


class HostCall(NamedTuple):
    """One library call of a window (HostStep.plan)."""
    settings: dict  # the group's AdamW settings
    count: int  # the step count the call steps to
    master: bool
    members: list  # (parameter, view of its gradient on the host)
    states: list
    # The parameters', gradients', exp_avg's and exp_avg_sq's addresses, and for masters
    # the outputs'
    arguments: tuple
    counts: list  # elements
    outputs: "list | None"  # views of a pinned buffer for the bf16 masters
    targets: "list | None"  # Note [Windows prepared ahead]: the working copies, flattened


def count_steps(states: list, batched: bool) -> None:
    """Each state's step count, one higher; `batched`: the tensors' in one PyTorch call."""
    tensors = [state["step"] for state in states if torch.is_tensor(state["step"])]
    if batched and tensors:
        torch._foreach_add_(tensors, 1)
    for state in states:
        if not torch.is_tensor(state["step"]):
            state["step"] = state["step"] + 1
        elif not batched:
            state["step"] += 1


def all_masters(stepper) -> list:
    """The optimizer's parameters that are masters (Note [Master weights]), in order."""
    return [p for group in stepper.optimizer.param_groups for p in group["params"]
            if working_of(stepper, p) is not None]


def stream_of(handle: int, device) -> "torch.cuda.Stream":
    """The stream `handle` names on `device`; 0 names the current one. Not
    torch.cuda.ExternalStream(0): that is a stream of PyTorch's pool, not the default stream
    (whose handle is 0), and an event waited for there orders nothing the program queues."""
    current = torch.cuda.current_stream(device)
    if not handle or handle == current.cuda_stream:
        return current
    return torch.cuda.ExternalStream(handle, device=device)


def working_of(stepper, parameter):
    """The working copy of `parameter` when it is a master (Note [Master weights])."""
    masters = getattr(stepper, "masters", None)
    return masters.working(parameter) if masters is not None else None


class HostRun:
    """The host side of one step, running on its thread (HostStep.start)."""

    def __init__(self):
        self.thread: "threading.Thread | None" = None
        # Parameter lists left to the device: refused (a part of them on the device), or not
        # reached when the thread failed.
        self.refused: list = []
        self.done = 0  # windows finished
        self.error: "BaseException | None" = None
        # Note [The host step finishes behind the forward]: what waits for windows reads
        # these under `changed`: per window finished, the event after the copies into the
        # working copies up to it (None: none yet); the bf16 gradients of refused masters;
        # whether the thread has ended.
        self.changed = threading.Condition()
        self.written: list = []
        self.saved: dict = {}
        self.finished = False
        self.gradients_copied = None  # queued ahead: the event after every copy
        self.optimizer = None  # held while the run may still step with it (HostStep.start)

    def join(self) -> list:
        """Waits for the thread; returns what is left to step on the device (the caller
        steps it, then raises `error` if there is one)."""
        if self.thread is not None:
            self.thread.join()
        return self.refused


class Behind:
    """Note [The host step finishes behind the forward]: a run the CPUs finish after the
    step returned, and what its waits need."""

    def __init__(self, stepper, step_run, run: HostRun, chosen: list, device):
        self.stepper = stepper
        self.step_run = step_run  # the windowed step's StepRun (its saved param_groups)
        self.run = run
        self.device = device
        self.turns = len(chosen)
        # The storage of each working copy of the run, and its window's turn; each working
        # copy's turn by its identity, and the working copies.
        self.window_of = {}
        self.turn_of: dict = {}
        self.workings: list = []
        for turn, (_, hosted) in enumerate(chosen):
            for master in hosted:
                working = working_of(stepper, master)
                if working is not None:
                    self.window_of[working.untyped_storage().data_ptr()] = turn
                    self.turn_of[id(working)] = turn
                    self.workings.append(working)
        self.ordered: dict = {}  # stream -> the last turn it was ordered after
        # Note [Behind the forward, guarded]: whether the working copies are guarded, the
        # streams ordered after the whole run since it finished, and the events after the
        # refused parameters' steps on the device.
        self.guarded = False
        self.finally_ordered: set = set()
        self.stepped_after: list = []
        self.stepping_thread = None
        self.steps_done = threading.Condition()  # stepping and stepping_thread change under it
        # Set once nothing of the run is left to do on the host: what every stream orders
        # after from then on (its last copies, the refused parameters' steps).
        self.settled = threading.Event()
        self.final_events: list = []
        self.stepping = False  # refused parameters are being stepped on the device
        # Each group's settings as the step saw them (a scheduler changes them after it):
        # refused parameters step on the device with these.
        self.settings = [{key: value for key, value in group.items() if key != "params"}
                         for group in stepper.optimizer.param_groups]

    def settle(self, stepped_after: list) -> None:
        """Nothing of the run is left on the host: the events after its last copies and
        `stepped_after` are what a stream orders after from now on."""
        if self.settled.is_set():
            return
        with self.run.changed:
            last = self.run.written[-1] if self.run.written else None
        self.final_events = ([last] if last is not None else []) + list(stepped_after)
        self.settled.set()


#: Note [The host step finishes behind the forward]: the host steps with a run behind.
behind_steps: list = []


def wait_behind(tensors: list, stream: int) -> None:
    """Before a hinted use (_use_hints.before_use): a use of working copies that a run still
    on the CPUs writes waits for their windows."""
    for host in list(behind_steps):
        host.before_use(tensors, stream)


def _present(names, getter: bool) -> list:
    """The Tensor attributes of `names` this PyTorch has: their getters, or themselves."""
    found = [getattr(torch.Tensor, name, None) for name in names]
    return [item.__get__ if getter else item for item in found if item is not None]


#: id(working copy) -> (its HostStep, the Behind that guards it); changed under guard_lock
guarded: dict = {}
guard_lock = threading.Lock()
#: Note [Behind the forward, guarded]: the class of guarded working copies, and the calls that
#: read no bytes of a tensor, which it lets through without waiting. Made at the first
#: guard (guarded_class): this module may be imported while PyTorch itself is, before
#: torch.nn exists.
GuardedParameter = None
NO_BYTES: frozenset = frozenset()


def guarded_class():
    """GuardedParameter, made on first use."""
    global GuardedParameter, NO_BYTES
    if GuardedParameter is not None:
        return GuardedParameter
    NO_BYTES = frozenset(
        _present(("grad", "requires_grad", "shape", "dtype", "device", "is_cuda", "ndim",
                  "is_leaf", "grad_fn", "layout", "is_sparse", "is_quantized", "is_meta",
                  "_version"), getter=True)
        + [torch.Tensor.grad.__set__, torch.Tensor.requires_grad.__set__]
        + _present(("size", "dim", "numel", "nelement", "element_size", "stride",
                    "is_contiguous", "storage_offset", "get_device", "__hash__", "__len__",
                    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
                    "is_floating_point", "is_complex", "is_pinned"), getter=False))

    class Guarded(torch.nn.Parameter):
        """Note [Behind the forward, guarded]: a working copy that a run behind the forward
        may still write. A call that takes it waits for its window first, on any thread."""

        def __new__(cls, data=None, requires_grad=True):
            # type(p)(data), as some libraries rebuild a parameter: a plain one.
            return torch.nn.Parameter(data, requires_grad)

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func not in NO_BYTES:
                for tensor in guarded_in(args, kwargs):
                    owner = guarded.get(id(tensor))
                    if owner is not None:
                        owner[0].guard_wait(owner[1], tensor)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)

        def __repr__(self, *args, **kwargs):
            """As a plain nn.Parameter's, once its window is written."""
            return repr(torch.nn.Parameter(self.data, self.requires_grad))

        def __deepcopy__(self, memo):
            """As nn.Parameter's, of nn.Parameter: a copy (an EMA model) is not guarded."""
            if id(self) not in memo:
                memo[id(self)] = torch.nn.Parameter(
                    self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
            return memo[id(self)]

    Guarded.__name__ = Guarded.__qualname__ = "GuardedParameter"
    GuardedParameter = Guarded
    return Guarded


def guarded_in(args, kwargs):
    """The guarded parameters among a call's arguments, and in its lists and tuples (the
    foreach calls)."""
    for value in (*args, *kwargs.values()):
        if type(value) is GuardedParameter:
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if type(item) is GuardedParameter:
                    yield item


def guard_proof(workings: list) -> bool:
    """Note [Behind the forward, guarded]: whether every read of `workings` goes through the
    parameters themselves: plain nn.Parameters whose storages nothing else holds, no graph
    being captured, nothing compiled by torch.compile in this process."""
    if captured[0] or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return False
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        counters = getattr(getattr(dynamo, "utils", None), "counters", {})
        if counters.get("stats", {}).get("unique_graphs", 0):
            return False
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    if not alone_uses:  # what a parameter no other tensor shares reads on this PyTorch
        alone = torch.nn.Parameter(torch.empty(1))
        alone_uses.append(use_count(alone.untyped_storage()._cdata))
    baseline = alone_uses[0]
    for working in workings:
        if type(working) is not torch.nn.Parameter:
            return False
        if use_count(working.untyped_storage()._cdata) != baseline:
            return False
    return True


#: The storage use count of a parameter no other tensor shares (the parameter's own reference,
#: and the storage object asked for it where that counts), read once.
alone_uses: list = []

#: Whether a CUDA graph was ever captured in this process (watch_captures): its replays read
#: the weights through pointers no guard sees.
captured = [False]


def watch_captures() -> None:
    """Notes every capture of a CUDA graph from now on (torch.cuda.CUDAGraph.capture_begin,
    which torch.cuda.graph, make_graphed_callables and CUDA graph trees call). Under the swap
    a capture is refused anyway (Note [CUDA graphs under the swap] in _swap.py); with
    LD_PRELOAD and zt.offload it is not."""
    graph = getattr(torch.cuda, "CUDAGraph", None)
    begin = getattr(graph, "capture_begin", None)
    if begin is None or getattr(begin, "_zeroalloc_watched", False):
        return

    def capture_begin(self, *args, **kwargs):
        captured[0] = True
        return begin(self, *args, **kwargs)

    capture_begin._zeroalloc_watched = True
    graph.capture_begin = capture_begin


def guard(behind: "Behind") -> None:
    """The run's working copies guarded until its copies are done."""
    host = behind.stepper.host
    kind = guarded_class()
    with guard_lock:
        for working in behind.workings:
            guarded[id(working)] = (host, behind)
            working.__class__ = kind
        behind.guarded = True


def unguard(behind: "Behind") -> None:
    """The run's working copies plain nn.Parameters again."""
    with guard_lock:
        for working in behind.workings:
            if guarded.get(id(working), (None, None))[1] is behind:
                guarded.pop(id(working), None)
                if type(working) is GuardedParameter:
                    working.__class__ = torch.nn.Parameter
        behind.guarded = False


def unguard_settled() -> None:
    """Note [Behind the forward, guarded]: runs with nothing left on the host whose working
    copies are still guarded (their last copies ran when last asked) are waited for and
    unguarded."""
    with guard_lock:
        behinds = list({id(b): b for _, b in guarded.values()}.values())
    for behind in behinds:
        if behind.settled.is_set():
            for event in behind.final_events:
                event.synchronize()
            unguard(behind)


def finish_every_behind() -> None:
    """Every run still on the CPUs finishes (refused parameters stepped on the device)."""
    unguard_settled()
    for host in list(behind_steps):
        host.finish_behind()


def finish_at_exit() -> None:
    try:
        finish_every_behind()
    except Exception as error:  # noqa: BLE001  the process is ending: say so, go on
        warnings.warn(f"zeroalloc: the host step's last windows failed at exit: {error}")


atexit.register(finish_at_exit)


