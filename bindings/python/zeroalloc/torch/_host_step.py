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
runs here; the rest steps on the device.
"""

from __future__ import annotations

import threading
import time

import torch

from zeroalloc import _offload
from zeroalloc.torch._step_records import residency_or_foreign

ON_HOST = ("host", "host_unmapped")


def adamw_settings(optimizer, group) -> "dict | None":
    """The group's AdamW settings when the host step can run them, else None."""
    if isinstance(optimizer, torch.optim.AdamW):
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
    return (tensor.dtype == torch.float32 and tensor.is_contiguous()
            and tensor.storage_offset() == 0
            and tensor.untyped_storage().nbytes() == tensor.numel() * 4)


class HostStep:
    """The host side of one windowed step's windows (Note [Host windows])."""

    def __init__(self):
        self.buffers = [None, None]  # pinned host memory for the gradients, double-buffered
        self.stream = None
        self.figures = {"host_windows": 0, "host_bytes": 0, "host_s": 0.0,
                        "host_refused": 0}

    def eligible(self, stepper, parameter, places: dict, groups: dict) -> bool:
        """Whether the parameter can be stepped on the host: AdamW settings it runs, fp32
        whole tensors, states created, and the parameter and its states on the host (as
        `places` says, or asked now)."""
        group = groups.get(id(parameter))
        if group is None or adamw_settings(stepper.optimizer, group) is None:
            return False
        state = stepper.optimizer.state.get(parameter, {})
        grad = parameter.grad
        if (grad is None or "exp_avg" not in state or "exp_avg_sq" not in state
                or "step" not in state or not grad.is_cuda):
            return False
        tensors = (parameter, state["exp_avg"], state["exp_avg_sq"])
        if not all(whole_fp32(t) for t in tensors + (grad,)):
            return False
        for tensor in tensors:
            place = places.get(id(tensor))
            if place is None:
                place = places[id(tensor)] = residency_or_foreign(tensor)
            if place not in ON_HOST:
                return False
        return True

    def copy_gradients(self, window, slot: int, after) -> tuple:
        """Starts copying the window's gradients into pinned buffer `slot`, after the event
        `after` (the backward's end); returns (what the CPUs read for each: a view of the
        buffer, or the gradient itself when it is on the host, event after the copies)."""
        # A gradient the engine moved to the host (zt.offload's gradient_class) is read
        # there; the others are copied.
        there = {id(p) for p in window if residency_or_foreign(p.grad) == "host"}
        total = sum(p.grad.numel() for p in window if id(p) not in there)
        buffer = self.buffers[slot]
        if total and (buffer is None or buffer.numel() < total):
            buffer = self.buffers[slot] = torch.empty(total, dtype=torch.float32,
                                                      pin_memory=True)
        views, offset = [], 0
        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            for parameter in window:
                if id(parameter) in there:
                    views.append(parameter.grad)
                    continue
                count = parameter.grad.numel()
                view = buffer[offset:offset + count]
                view.copy_(parameter.grad.view(-1), non_blocking=True)
                parameter.grad.record_stream(self.stream)
                views.append(view)
                offset += count
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
        after = torch.cuda.Event()
        after.record(main)  # the backward's end: the copies need nothing main queues later
        run = HostRun()

        def work() -> None:
            try:
                with torch.cuda.device(device):
                    copies: dict = {}
                    for turn, (number, hosted) in enumerate(chosen):
                        if turn == 0:
                            copies[number] = self.copy_gradients(hosted, 0, after)
                        if turn + 1 < len(chosen):  # the next one's, while the CPUs work
                            following, its_hosted = chosen[turn + 1]
                            copies[following] = self.copy_gradients(its_hosted, (turn + 1) % 2,
                                                                     after)
                        if not self.step(stepper, hosted, copies.pop(number), groups):
                            run.refused.append(hosted)
            except BaseException as error:  # noqa: BLE001  raised again by join()
                run.error = error

        run.thread = threading.Thread(target=work, name="zeroalloc-host-step", daemon=True)
        run.thread.start()
        return run

    def step(self, stepper, window, gradients: tuple, groups: dict) -> bool:
        """Steps the window on the CPUs once its gradients are on the host; False when the
        library found a part of it on the device (nothing changed)."""
        views, copied = gradients
        copied.synchronize()
        started = time.perf_counter()
        # One call per group and step count (the bias corrections differ between counts).
        batches: dict = {}
        for parameter, view in zip(window, views):
            group = groups[id(parameter)]
            state = stepper.optimizer.state[parameter]
            count = int(state["step"].item() if torch.is_tensor(state["step"])
                        else state["step"]) + 1
            batches.setdefault((id(group), count), (group, []))[1].append((parameter, view))
        if len(batches) > 1:  # one call steps the window, or none does: never half of it
            self.figures["host_refused"] += 1
            return False
        try:
            for (_, count), (group, members) in batches.items():
                settings = adamw_settings(stepper.optimizer, group)
                states = [stepper.optimizer.state[p] for p, _ in members]
                stepped = _offload.adamw_on_host(
                    [p.untyped_storage().data_ptr() for p, _ in members],
                    [view.data_ptr() for _, view in members],
                    [s["exp_avg"].untyped_storage().data_ptr() for s in states],
                    [s["exp_avg_sq"].untyped_storage().data_ptr() for s in states],
                    [p.numel() for p, _ in members], step=count, stream=self.stream.cuda_stream,
                    **settings)
                if not stepped:
                    self.figures["host_refused"] += 1
                    return False
                for state in states:
                    if torch.is_tensor(state["step"]):
                        state["step"] += 1
                    else:
                        state["step"] = state["step"] + 1
        finally:
            self.figures["host_s"] += time.perf_counter() - started
        self.figures["host_windows"] += 1
        self.figures["host_bytes"] += sum(p.numel() * 4 for p in window)
        return True


class HostRun:
    """The host side of one step, running on its thread (HostStep.start)."""

    def __init__(self):
        self.thread: "threading.Thread | None" = None
        self.refused: list = []  # parameter lists the library found partly on the device
        self.error: "BaseException | None" = None

    def join(self) -> list:
        """Waits for the thread; returns what it refused (to step on the device), or raises
        what it raised."""
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        return self.refused
