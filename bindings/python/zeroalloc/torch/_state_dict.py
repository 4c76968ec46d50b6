"""The optimizer's state_dict and load_state_dict under offload(): the states the windowed
step kept in scratch go home first, and loaded states move into their class. The model's
state_dict: parameters the engine may leave behind unmapped addresses (in the NVMe tier, or
parked) come out as CPU copies."""

from __future__ import annotations

import functools
import threading

import torch

from zeroalloc import _offload
from zeroalloc.torch import _adoption, _settings, _use_hints
from zeroalloc.torch._master_weights import finish_every_behind, refresh_every
from zeroalloc.torch._step_records import residency_or_foreign
from zeroalloc.torch._transient import ModuleHook
from zeroalloc.torch._weak_methods import BoundWeakly, original_of, unbound


def readopt_after_load(optimizer) -> None:
    """optimizer.load_state_dict rebuilds the states in the default class: move them back
    into the optimizer-state class, where the engine may page them. Both it and state_dict
    first put back the states the windowed step kept in scratch (Note [Overlapping the
    step])."""
    if getattr(optimizer.load_state_dict, "_zeroalloc_readopts", False):
        return
    # Unbound, and stored weakly bound (Note [No cycles through the optimizer]).
    original_load = optimizer.load_state_dict
    load = unbound(original_load, optimizer)

    def load_state_dict(self, state_dict):
        stepper = getattr(self, "_zeroalloc_stepper", None)
        if stepper is not None:  # states kept or staged by the last step go home first
            stepper.settle()
        load(self, state_dict)
        _adoption.adopt([], self)

    load_state_dict._zeroalloc_readopts = True
    # What OffloadHandle.remove() puts back.
    load_state_dict._zeroalloc_original = original_of(optimizer, "load_state_dict")
    optimizer.load_state_dict = BoundWeakly(load_state_dict, optimizer)
    original_state_dict = optimizer.state_dict
    save = unbound(original_state_dict, optimizer)

    def state_dict(self):
        stepper = getattr(self, "_zeroalloc_stepper", None)
        if stepper is not None:  # kept states: their own tensors, not views of a slot
            stepper.write_back_kept(wait=True)
        return copied_off_disk(self, save(self))

    state_dict._zeroalloc_original = original_of(optimizer, "state_dict")
    optimizer.state_dict = BoundWeakly(state_dict, optimizer)


def copy_parameters_off_disk(module, state_dict, prefix, local_metadata) -> None:
    """A state_dict post-hook of the model under offload(): a parameter may sit in the NVMe
    tier (ZEROALLOC_NVME_PARAMETERS) or be parked on the host (ZEROALLOC_PARK_PARAMETERS),
    behind addresses no copy may touch, so that torch.save would fail with an illegal
    address. Each such entry becomes a CPU copy made
    while a use pins it where it came back to (as copied_off_disk does for states); the
    rest stay the module's own tensors."""
    # Note [Parameters parked]: with parking on, any parameter the engine manages may be
    # parked after this returns (an eviction as the use below ends, or the program's next
    # allocation), and torch.save would then read unmapped addresses: each one comes out as
    # a CPU copy, as torch.save would make anyway. Other tensors (buffers, parameters
    # offload() did not adopt) are never parked and stay the module's own.
    # So too with parameters in the NVMe tier: one on the host or the device as this looks
    # may be on disk by the time torch.save reads it.
    adopted = set()
    if _settings.parameters_park() or _settings.parameters_on_disk():
        adopted = {p.untyped_storage().data_ptr() for p in adopted_parameters(module)}
    values = [(key, value) for key, value in state_dict.items()
              if not isinstance(value, torch.nn.Parameter)]  # keep_vars=True: live objects
    for key, value in values:
        copied = cpu_copy_if_on_disk(
            value, torch.is_tensor(value) and value.untyped_storage().data_ptr() in adopted)
        if copied is not None:
            state_dict[key] = copied


def cpu_copy_if_on_disk(value, wherever: bool = False):
    """A CPU copy of `value` when any of it is in the NVMe tier or parked (or moving), or
    with `wherever` wherever the engine holds it, made while a use in place pins it where it
    came back to (mapped; the pin's fetch arrives in the current stream's order, which the
    copy follows); None for anything else."""
    if not (torch.is_tensor(value) and value.numel() > 0):
        return None
    where = residency_or_foreign(value)
    # Under ZEROALLOC_ACCESS=any nothing is parked or on disk, and no move is under way once
    # a call returns: a tensor split between device and host is addressable as it is, and
    # the dict keeps the tensor itself, on its device, as natively.
    unreachable = (("disk", "host_unmapped") if _settings.any_access()
                   else ("disk", "host_unmapped", "split", "moving"))
    if where == "foreign" or (not wherever and where not in unreachable):
        return None
    pointer = value.untyped_storage().data_ptr()
    stream = _use_hints.current_stream(value.get_device()) if value.is_cuda else 0
    _offload.use_in_place_many([pointer], stream)  # back from the disk, pinned
    try:
        return value.to("cpu", copy=True)
    finally:
        _offload.use_ends_many([pointer], stream)


def adopted_parameters(module) -> list:
    """The module's parameters that offload() moved into the parameter class (the ones the
    engine may park), empty ones left out."""
    return [p for p in module.parameters()
            if getattr(p, "_zeroalloc_adopted", False) and p.numel() > 0]


def pin_parameters_for_load(module) -> list:
    """Note [Parameters parked]: load_state_dict writes every parameter without a hint; the
    ones the engine manages are pinned where they are for it (a parked one fetched, or
    mapped on the host). Returns what to unpin (pins_end)."""
    if not _settings.parameters_park():
        return []
    adopted = adopted_parameters(module)
    if adopted:
        _use_hints.hint(_offload.use_in_place_many, adopted, 0)
    return adopted


def pins_end(pinned: list) -> None:
    if pinned:
        _use_hints.end(pinned)


def pin_during_load(model) -> list:
    """The load_state_dict hooks of a model under offload(): its managed parameters pinned
    from the start of the load (the root's pre-hook runs first) to its end."""
    pinned: list = []

    def before(module, *args, **kwargs):
        if module is model and not pinned:
            finish_every_behind()  # the load's copies after the CPUs' writes
            pinned.extend(pin_parameters_for_load(model))

    def after(module, incompatible_keys):
        pins_end(pinned)
        pinned.clear()

    before, after = ModuleHook(before), ModuleHook(after)  # Note [Nothing of ours is pickled]
    register = getattr(model, "register_load_state_dict_pre_hook", None)
    first = (register(before) if register is not None
             else model._register_load_state_dict_pre_hook(before, with_module=True))
    return [first, model.register_load_state_dict_post_hook(after)]


def copy_parameters_off_disk_in_every_model() -> None:
    """The no-code-change mode's form of copy_parameters_off_disk: it knows no model, so
    every module's state_dict is wrapped, and the outermost call (the one whose dict holds
    the whole model; its children's calls are nested in it) copies what is on disk. Once
    per process."""
    original = torch.nn.Module.state_dict
    if getattr(original, "_zeroalloc_copies_off_disk", False):
        return
    depth = threading.local()

    @functools.wraps(original)
    def state_dict(self, *args, **kwargs):
        level = getattr(depth, "value", 0)
        if level == 0:  # the working copies, once the CPUs wrote them
            finish_every_behind()
        depth.value = level + 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            depth.value = level
        if level == 0 and isinstance(result, dict):
            copy_parameters_off_disk(self, result, "", None)
        return result

    state_dict._zeroalloc_copies_off_disk = True
    torch.nn.Module.state_dict = state_dict
    original_load = getattr(torch.nn.Module, "load_state_dict", None)
    if original_load is None:
        return

    @functools.wraps(original_load)
    def load_state_dict(self, *args, **kwargs):  # Note [Parameters parked]
        level = getattr(depth, "value", 0)
        if level == 0:  # the load's copies after the CPUs' writes
            finish_every_behind()
        pinned = pin_parameters_for_load(self) if level == 0 else []
        depth.value = level + 1
        try:
            result = original_load(self, *args, **kwargs)
        finally:
            depth.value = level
            pins_end(pinned)
        if level == 0:  # Note [Master weights]: the masters take what was loaded
            refresh_every(self)
        return result

    torch.nn.Module.load_state_dict = load_state_dict


def copied_off_disk(optimizer, saved: dict) -> dict:
    """States in the NVMe tier sit behind addresses no kernel or copy may touch (Note
    [Chunks on disk] in lib/tier/migrator.cpp), and pressure may send a state there again
    at any time after state_dict returns: in the dict it returns (for torch.save), each
    such state is a copy in CPU memory, made while a use pins it where it came back to.
    With the NVMe tier configured that holds for every state the engine manages, wherever
    it is as this looks: one on the host now may be on disk by the time torch.save reads
    it (a CPU copy is what torch.save makes anyway). Without it, states stay the
    optimizer's own tensors."""
    wherever = _settings.disk_tier()
    on_disk = {}
    for per_parameter in optimizer.state.values():
        for value in per_parameter.values():
            copied = cpu_copy_if_on_disk(value, wherever)
            if copied is not None:
                on_disk[id(value)] = copied
    if not on_disk:
        return saved
    state = {index: {key: on_disk.get(id(value), value) for key, value in per.items()}
             for index, per in saved["state"].items()}
    return {**saved, "state": state}
