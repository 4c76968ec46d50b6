"""Adoption: parameters, gradients and optimizer states moved into their allocation
classes, where the offload engine may page them."""

from __future__ import annotations

import warnings
import weakref

import torch

from zeroalloc import _offload, _stats
from zeroalloc.torch import _use_hints
from zeroalloc.torch._backward_uses import BackwardUses, backward_uses
from zeroalloc.torch._gradient_choice import GradientChoice
from zeroalloc.torch._transient import MARK

#: Bumped whenever a parameter is adopted: the automatic mode's per-module group decisions,
#: made from the managed bytes under a module, are stale after that.
adoptions = [0]


def move_into_class(tensor: "torch.Tensor", name: str) -> "torch.Tensor":
    with _stats.allocation_class(name):
        moved = torch.empty_like(tensor)
    if name != "optimizer_state" or not moved.is_cuda:
        moved.copy_(tensor)
        return moved
    # An optimizer state may go to disk before any hint reached it (Note [States never used
    # yet] in lib/tier/offload_engine.cpp): its first touch, this copy, is hinted too, so
    # that it comes back first if it went in between.
    _use_hints.hint(_offload.use_in_place_many, [moved], 0)
    try:
        moved.copy_(tensor)
    finally:
        _use_hints.hint(_offload.use_ends_many, [moved], 0)
    return moved


#: The kinds of parameters adopt() left to their framework, each told once.
unmanaged_told: set = set()


def warn_unmanaged_once(parameter) -> None:
    kind = type(parameter).__name__
    if kind in unmanaged_told:
        return
    unmanaged_told.add(kind)
    warnings.warn(f"zeroalloc: parameters of type {kind} have no storage of their own "
                  "(FSDP2's sharded DTensor, or storage FSDP freed): they stay with the "
                  "framework that owns them and are not put in the parameter class. "
                  "Training runs as without zeroalloc's hints for them.", stacklevel=3)


def storageless_parameter(optimizer):
    """The first of the optimizer's parameters with no storage of its own (FSDP2's
    DTensors), or None. FSDP2 owns such parameters' memory and their step: an optimizer over
    them stays as PyTorch made it."""
    return next((p for group in optimizer.param_groups for p in group["params"]
                 if not _use_hints.storage_pointer(p)), None)


def is_paged_state(value) -> bool:
    """A state the windowed step pins and may bounce: a non-empty tensor on a GPU (the step
    count of foreach optimizers is a scalar on the CPU)."""
    return torch.is_tensor(value) and value.is_cuda and value.dim() > 0 and value.numel() > 0


def adopt(parameters, optimizer=None, gradients: "GradientChoice | None" = None,
          hooked: "list | None" = None, backward: BackwardUses = backward_uses) -> list:
    """Moves parameters (and the optimizer's existing states) into their allocation classes
    and hints the end of each parameter's backward use; while the choice `gradients` is on
    (Note [Gradients' class, decided]), gradients go into theirs too (Note [Gradients'
    class]). Returns the hooks; appends the
    parameters it hooked to `hooked`, each as (parameter, the mark of its hook). A parameter
    hooked before gets only what it lacks: the gradient class's hook when asked for now. Of the
    optimizer's states only those the windowed step pins and hints move (a scalar step
    count on the device stays with the activations: unhinted use must not share a hinted
    class)."""
    hooks = []
    # Off, or "auto" not trying the class (yet): no hook, so the backward runs as without
    # one; the windowed step adds the hooks when a trial begins.
    choice = gradients if gradients is not None and gradients.on else None
    with torch.no_grad():
        for parameter in parameters:
            # Another rank's at ZeRO stage 3 (Note [Stage 3 under offload]): never managed.
            if not parameter.is_cuda or getattr(parameter, "_zeroalloc_not_owned", False):
                continue
            if not _use_hints.storage_pointer(parameter):
                # FSDP2's DTensor, or a storage FSDP freed: the framework owns its memory.
                # It stays where the framework put it (the engine still moves it under
                # pressure, as any allocation), and the program runs as natively.
                warn_unmanaged_once(parameter)
                continue
            if not getattr(parameter, "_zeroalloc_adopted", False):
                parameter.data = move_into_class(parameter.data, "parameter")
                parameter._zeroalloc_adopted = MARK  # Note [Nothing of ours is pickled]
                adoptions[0] += 1
            if not parameter.requires_grad:
                continue
            if not getattr(parameter, "_zeroalloc_hooked", False):
                parameter._zeroalloc_hooked = MARK
                if hooked is not None:
                    hooked.append((parameter, "_zeroalloc_hooked"))
                hooks.append(parameter.register_post_accumulate_grad_hook(backward.end))
            if choice is not None:
                hooks += hook_gradient(parameter, choice, hooked)
        if optimizer is not None:
            for state in optimizer.state.values():
                for key, value in list(state.items()):
                    if is_paged_state(value) and _use_hints.storage_pointer(value):
                        state[key] = move_into_class(value, "optimizer_state")
    return hooks


def hook_gradient(parameter, choice: GradientChoice, hooked: "list | None",
                  move_existing: bool = True) -> list:
    """The hook of Note [Gradients' class] on `parameter`, unless it has one (returned, in a
    list; `hooked` as adopt's); with `move_existing`, a gradient it holds now moves into
    the class first. The mark (the choice the hook reads; _zero.gradient_class_of reads it
    too) and the hook's handle go on the parameter once the hook is there."""
    if getattr(parameter, "_zeroalloc_gradient_hooked", None):
        return []
    if move_existing and parameter.grad is not None and not parameter.grad.is_sparse:
        with torch.no_grad():
            parameter.grad = move_into_class(parameter.grad, "gradient")
    handle = parameter.register_hook(gradient_into_class(parameter, choice))
    parameter._zeroalloc_gradient_hooked = choice
    parameter._zeroalloc_gradient_hook = handle
    if hooked is not None:
        hooked.append((parameter, "_zeroalloc_gradient_hooked"))
    return [handle]


def unhook_gradients(parameters, choice: GradientChoice) -> list:
    """Takes out the gradient hooks of `choice` from `parameters`; returns those it took
    them from (Note [Gradients' class, decided]: a trial that ended off)."""
    gone = []
    for parameter in parameters:
        if getattr(parameter, "_zeroalloc_gradient_hooked", None) is choice:
            handle = parameter.__dict__.pop("_zeroalloc_gradient_hook", None)
            if handle is not None:
                handle.remove()
            del parameter._zeroalloc_gradient_hooked
            gone.append(parameter)
    return gone


def unmark(references: list) -> None:
    """Clears the marks of the hooks taken out: (weak reference to a parameter, mark)."""
    for reference, mark in references:
        parameter = reference()
        if parameter is not None:
            parameter.__dict__.pop(mark, None)
            if mark == "_zeroalloc_gradient_hooked":
                parameter.__dict__.pop("_zeroalloc_gradient_hook", None)


def gradient_into_class(parameter, choice: GradientChoice):
    """Note [Gradients' class]: autograd allocates a parameter's gradient in the kernel that
    computes it, on its own thread and in the activations' class, and the accumulation into
    an empty `.grad` adopts that tensor as it is. So the hook on the parameter copies the
    first gradient of a backward into the gradient class (the accumulation then adopts the
    copy); later ones, with `.grad` there, are added into it in place. The copy costs each
    gradient's bytes once a step, read and written on the device. In their own class,
    gradients are what pressure moves last, and only when an allocation would fail (Note
    [Residency policy]); in the activations' class they move only after every other class,
    as the last resort. While `choice` is off (Note [Gradients' class, decided]) the hook
    leaves the gradient where autograd put it."""
    owner = weakref.ref(parameter)

    def hook(gradient):
        if not choice.on:
            return None
        held = owner()
        # Under create_graph the accumulation copies whatever it gets: nothing to gain.
        if (held is None or held.grad is not None or gradient.is_sparse
                or torch.is_grad_enabled()):
            return None
        with _stats.allocation_class("gradient"):
            # The parameter's strides: the accumulation adopts only a gradient laid out like
            # its parameter, and copies any other (in the activations' class).
            moved = torch.empty_like(held, memory_format=torch.preserve_format)
        moved.copy_(gradient)
        return moved

    return hook

