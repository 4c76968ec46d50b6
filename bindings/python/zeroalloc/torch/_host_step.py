"""AdamW windows stepped on the host's CPUs where their states are (ZEROALLOC_HOST_STEP; Note
[Stepped on the host] in lib/tier/host_step.hpp).

Note [Host windows]: the windowed step asks, before it stages anything, which of its
windows have every parameter and state on the host (the residency it asks anyway). Those
windows are not bounced: their gradients are copied into pinned host buffers on a copy
stream, one window ahead of the CPUs, and the library steps the window on the CPUs of the
GPU's NUMA node, reading and writing the states and parameters at their host copies. The
parameters stay on the host; the next forward fetches them as it fetches any evicted
parameter. A window the engine moved meanwhile (the library answers that a chunk is on the
device) is staged and stepped on the device as any other. Only torch.optim.AdamW (and Adam
without weight decay, the same update), fp32, without amsgrad, capturable or differentiable
runs here; the rest steps on the device. With master weights (Note [Master weights] in
_master_weights.py) the gradients copied are the working copies' bf16 ones, and the CPUs
write each updated master rounded to bf16 into pinned buffers, copied into the working
copies on the same stream, which the step's stream waits for.
"""

from __future__ import annotations

import threading
import time
import warnings

import torch

from zeroalloc import _offload
from zeroalloc.torch import _use_hints
from zeroalloc.torch._step_records import residency_or_foreign

ON_HOST = ("host", "host_unmapped")


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


def whole_fp32(tensor) -> bool:
    """A float32 tensor that is its storage's whole allocation, from its start."""
    return whole(tensor, torch.float32)


def whole(tensor, dtype) -> bool:
    """A `dtype` tensor that is its storage's whole allocation, from its start."""
    return (tensor.dtype == dtype and tensor.is_contiguous()
            and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


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
        self.figures = {"host_windows": 0, "host_bytes": 0, "host_s": 0.0,
                        "host_refused": 0, "host_copy_bytes": 0}

    def eligible(self, stepper, parameter, places: dict, groups: dict) -> bool:
        """Whether the parameter can be stepped on the host: AdamW settings it runs, fp32
        whole tensors, states created, and the parameter and its states on the host (as
        `places` says, or asked now)."""
        group = groups.get(id(parameter))
        if group is None or adamw_settings(stepper.optimizer, group) is None:
            return False
        state = stepper.optimizer.state.get(parameter, {})
        grad = stepper.gradient(parameter)
        if (grad is None or "exp_avg" not in state or "exp_avg_sq" not in state
                or "step" not in state or not grad.is_cuda):
            return False
        tensors = (parameter, state["exp_avg"], state["exp_avg_sq"])
        working = working_of(stepper, parameter)
        if working is not None:  # a master: a bf16 gradient, written back into bf16
            if not (whole(grad, torch.bfloat16) and working.dtype == torch.bfloat16
                    and working.is_contiguous() and working.is_cuda):
                return False
        elif not whole_fp32(grad):
            return False
        if not all(whole_fp32(t) for t in tensors):
            return False
        for tensor in tensors:
            place = places.get(id(tensor))
            if place is None:
                place = places[id(tensor)] = residency_or_foreign(tensor)
            if place not in ON_HOST:
                return False
        return True

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
            buffer = self.buffers[slot] = torch.empty(total, dtype=torch.uint8,
                                                      pin_memory=True)
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

    def start(self, stepper, chosen: list, groups: dict, main) -> "HostRun":
        """Steps `chosen` ((window number, its parameters on the host), in order) on a thread
        of its own, while the caller steps the rest of the windows on the device: each
        window's gradients are copied while the CPUs step the window before."""
        device = main.device
        if self.stream is None or self.stream.device != device:
            self.stream = torch.cuda.Stream(device)
            # What the library waits for before the CPUs read (the backward's end), apart
            # from the copies: waiting for the copy stream would wait for the next window's.
            self.fence = torch.cuda.Stream(device)
        after = torch.cuda.Event()
        after.record(main)  # the backward's end: the copies need nothing main queues later
        self.fence.wait_event(after)
        run = HostRun()

        def work() -> None:
            try:
                with torch.cuda.device(device):
                    copies: dict = {}
                    for turn, (number, hosted) in enumerate(chosen):
                        if turn == 0:
                            copies[number] = self.copy_gradients(stepper, hosted, 0, after)
                        if turn + 1 < len(chosen):  # the next one's, while the CPUs work
                            following, its_hosted = chosen[turn + 1]
                            copies[following] = self.copy_gradients(
                                stepper, its_hosted, (turn + 1) % 2, after)
                        run.done = turn
                        refused = self.step(stepper, hosted, copies.pop(number), groups,
                                            turn % 2)
                        if refused:
                            run.refused.append(refused)
                        run.done = turn + 1
            except BaseException as error:  # noqa: BLE001  raised by the caller after
                if isinstance(error, _offload.HostStepUnavailable):
                    # Never on this driver: the rest steps on the device, now and after.
                    warnings.warn(f"zeroalloc: {error}")
                    self.unavailable = True
                else:
                    run.error = error
                # What no call stepped goes to the device: the window being stepped less
                # what its finished calls stepped, and the windows after it.
                if run.done < len(chosen):
                    stepped = {id(p) for p in self.stepped}
                    current = [p for p in chosen[run.done][1] if id(p) not in stepped]
                    run.refused.extend(part for part in
                                       [current] + [h for _, h in chosen[run.done + 1:]] if part)

        run.thread = threading.Thread(target=work, name="zeroalloc-host-step", daemon=True)
        run.thread.start()
        return run

    def step(self, stepper, window, gradients: tuple, groups: dict, slot: int = 0) -> list:
        """Steps the window on the CPUs once its gradients are on the host, one library call
        per group, step count (the bias corrections differ between counts) and kind (masters
        or not), each all or nothing; returns the parameters of the calls the library refused
        (a part on the device: nothing of theirs changed)."""
        views, copied = gradients
        copied.synchronize()
        started = time.perf_counter()
        batches: dict = {}
        for parameter, view in zip(window, views):
            group = groups[id(parameter)]
            state = stepper.optimizer.state[parameter]
            count = int(state["step"].item() if torch.is_tensor(state["step"])
                        else state["step"]) + 1
            master = working_of(stepper, parameter) is not None
            batches.setdefault((id(group), count, master), (group, []))[1].append(
                (parameter, view))
        refused = []
        self.stepped = []  # what this window's finished calls stepped
        try:
            for (_, count, master), (group, members) in batches.items():
                settings = adamw_settings(stepper.optimizer, group)
                states = [stepper.optimizer.state[p] for p, _ in members]
                arguments = ([p.untyped_storage().data_ptr() for p, _ in members],
                             [view.data_ptr() for _, view in members],
                             [s["exp_avg"].untyped_storage().data_ptr() for s in states],
                             [s["exp_avg_sq"].untyped_storage().data_ptr() for s in states])
                counts = [p.numel() for p, _ in members]
                outputs = self.copy_buffers(members, slot) if master else None
                if master:
                    stepped = _offload.adamw_on_host_bf16(
                        *arguments, [o.data_ptr() for o in outputs], counts, step=count,
                        stream=self.fence.cuda_stream, **settings)
                else:
                    stepped = _offload.adamw_on_host(*arguments, counts, step=count,
                                                     stream=self.fence.cuda_stream, **settings)
                if not stepped:
                    self.figures["host_refused"] += 1
                    refused.extend(p for p, _ in members)
                    continue
                for state in states:
                    if torch.is_tensor(state["step"]):
                        state["step"] += 1
                    else:
                        state["step"] = state["step"] + 1
                # Stepped, whatever follows: a failure below must not hand them to the device
                # to be stepped again.
                self.stepped.extend(p for p, _ in members)
                self.figures["host_bytes"] += sum(p.numel() * 4 for p, _ in members)
                if master:
                    self.write_working(stepper, members, outputs, slot)
        finally:
            self.figures["host_s"] += time.perf_counter() - started
        if len(refused) < len(window):
            self.figures["host_windows"] += 1
        return refused


    def copy_buffers(self, members: list, slot: int) -> list:
        """Views of pinned buffer `slot` for the bf16 copies of `members`' masters, once the
        buffer's last copies to the device are done."""
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()
            self.copied[slot] = None
        total = sum(aligned(p.numel() * 2) for p, _ in members)
        buffer = self.copies[slot]
        if buffer is None or buffer.numel() < total:
            buffer = self.copies[slot] = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        views, offset = [], 0
        for parameter, _ in members:
            nbytes = parameter.numel() * 2
            views.append(buffer[offset:offset + nbytes].view(torch.bfloat16))
            offset += aligned(nbytes)
        return views

    def write_working(self, stepper, members: list, outputs: list, slot: int) -> None:
        """Queues the copies of the updated masters' bf16 values into their working copies
        on the copy stream (each a use of the working copy); the step's stream waits for
        that stream after the host's windows."""
        workings = [working_of(stepper, p) for p, _ in members]
        _use_hints.begin(workings, self.stream.cuda_stream)
        try:
            with torch.cuda.stream(self.stream):
                for working, output in zip(workings, outputs):
                    working.data.view(-1).copy_(output, non_blocking=True)
        finally:
            _use_hints.end(workings, self.stream.cuda_stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        self.copied[slot] = done
        self.figures["host_copy_bytes"] += sum(o.numel() * 2 for o in outputs)


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

    def join(self) -> list:
        """Waits for the thread; returns what is left to step on the device (the caller
        steps it, then raises `error` if there is one)."""
        if self.thread is not None:
            self.thread.join()
        return self.refused
