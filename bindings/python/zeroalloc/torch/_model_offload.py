"""offload(model, optimizer) and the automatic mode: adoption, module hints and the
windowed step put together, and the handle that takes them out again."""

from __future__ import annotations

import warnings
import weakref

import torch

from zeroalloc._library import ZeroallocError
from zeroalloc.torch import _adoption, _module_hints, _settings
from zeroalloc.torch._gradient_choice import GradientChoice, mode_of
from zeroalloc.torch._master_weights import MasterWeights, masters_of, working_dtype
from zeroalloc.torch._optimizer_step import steps_by_param_groups, windowed_step
from zeroalloc.torch._state_dict import (copy_parameters_off_disk,
                                         copy_parameters_off_disk_in_every_model,
                                         pin_during_load, readopt_after_load)
from zeroalloc.torch._transient import ModuleHook
from zeroalloc.torch._weak_methods import original_of, put_back


class OffloadHandle:
    """What offload() installed; remove() takes the hooks out again."""

    def __init__(self, hooks: list, optimizer, original_step, hooked=(), restore=None):
        self._hooks = hooks
        self._restore = restore  # a second offload() of a stepped optimizer: its sizes back
        self._optimizer = optimizer
        self._original_step = original_step
        # The parameters whose hooks it installed, weakly (the handle must not keep a
        # dropped model's memory), each with the mark of its hook.
        self._hooked = [(weakref.ref(parameter), mark) for parameter, mark in hooked]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        _adoption.unmark(self._hooked)  # a later offload() hooks them again
        self._hooked = []
        if self._restore is not None:
            self._restore()
            self._restore = None
        if self._optimizer is not None:
            optimizer = self._optimizer
            stepper = getattr(optimizer, "_zeroalloc_stepper", None)
            if stepper is not None:  # states it kept or staged go home first
                stepper.detach()
                for hook in stepper.late_hooks:
                    hook.remove()
                _adoption.unmark(stepper.late_hooked)
                del optimizer._zeroalloc_stepper
            masters = masters_of(optimizer)
            if masters is not None:  # fp32 parameters again, the masters' values
                masters.remove(optimizer)
                del optimizer._zeroalloc_masters
            put_back(optimizer, "step", self._original_step)
            for name in ("load_state_dict", "state_dict"):
                wrapper = optimizer.__dict__.get(name)
                function = getattr(wrapper, "__func__", None)
                if function is not None and hasattr(function, "_zeroalloc_original"):
                    put_back(optimizer, name, function._zeroalloc_original)
            self._optimizer = None
            self._original_step = None


def offload(model: "torch.nn.Module", optimizer: "torch.optim.Optimizer | None" = None, *,
            window_bytes: int = 1 << 30, hint_group_bytes: int = 256 << 20,
            overlap_bytes: int = 2 << 30, gradient_class: "bool | str | None" = None,
            master_weights=None) -> OffloadHandle:
    """Lets zeroalloc page the model's parameters and the optimizer's states between device
    and pinned host memory: two lines in a training script, after ``install()``::

        zt.install()
        ...
        zt.offload(model, optimizer)

    Parameters (and states that already exist) move into their own allocation classes;
    module hooks tell the engine when each module's parameters are used, so it learns the
    order of a step and fetches ahead (one hint per subtree of at most `hint_group_bytes` of
    parameters, Note [Hint groups]); the optimizer steps in windows of about
    `window_bytes` of parameters and states, so that only one window must be on the device at
    a time (PyTorch's foreach and fused optimizers would touch every state at once), and
    moves up to `overlap_bytes` of host-resident states each way while forward and backward
    run (Note [Overlapping the step]; the default, 2 << 30, measured best on an H200; 0:
    none). With `gradient_class=True`, each parameter's gradient is copied into the gradient
    class once a step, where pressure moves it before the activations (Note [Gradients'
    class]); with False, gradients stay with the activations, which move only as the last
    resort. "auto" (ZEROALLOC_OFFLOAD_GRADIENTS's default, which applies when it is not
    given) starts off, and tries the class once a step had to move activations to the host,
    keeping it only where it was not slower (Note [Gradients' class, decided]): in their own
    class gradients no longer reuse the memory the backward frees (0.73 x the tokens per
    second at 13.3 GiB of the 1.3B bench model, where the states alone make room), but they
    let a run train under a lower limit.
    With `master_weights` (True, "bf16" or torch.bfloat16; not given, ZEROALLOC_MASTER_WEIGHTS,
    else bf16 under ZEROALLOC_RECIPE=fast and none under exact), the model trains as DeepSpeed's bf16 mode does: its fp32 parameters become
    bf16 working copies and the optimizer steps fp32 masters, which the engine places with
    the optimizer's states (Note [Master weights] in _master_weights.py); only at the first
    offload() of a model and optimizer.
    Needs ZEROALLOC_OFFLOAD=host in the environment before the library loads."""
    _settings.require_offload_engine()
    mode = mode_of(_settings.gradient_class_default() if gradient_class is None
                   else gradient_class)
    if optimizer is not None:
        foreign = _adoption.storageless_parameter(optimizer)
        if foreign is not None:  # as in the automatic mode
            _adoption.warn_unmanaged_once(foreign)
            optimizer = None
    dtype = working_dtype(master_weights) if optimizer is not None else None
    stepper = getattr(optimizer, "_zeroalloc_stepper", None)
    # Note [Gradients' class, decided]: one choice per optimizer, which its hooks read; a
    # later offload() of a stepped optimizer that names gradient_class changes it.
    if stepper is not None:
        gradients = stepper.gradients
        # A mode this call changes is put back by remove(), with where the choice stood
        # (a decision made is kept); one it leaves keeps going.
        earlier_choice = None
        if gradient_class is not None and mode != gradients.mode:
            earlier_choice = gradients.snapshot()
            gradients.set_mode(mode)
    else:
        gradients = GradientChoice(mode)
    hooks: list = []
    if dtype is not None and masters_of(optimizer) is None:
        if stepper is not None:
            raise ZeroallocError("master weights must be made at the first offload() of an "
                                 "optimizer: this one is stepped by zeroalloc already")
        masters = MasterWeights(dtype)
        masters.make(optimizer)
        if len(masters):
            masters.install(optimizer)
            optimizer._zeroalloc_masters = masters
            hooks += masters.install_model_hook(model)
    hooked: list = []
    hooks += _adoption.adopt(model.parameters(), optimizer, gradients, hooked)
    hooks.append(hold_model_hooks(model, hint_group_bytes))

    def adopt(late, into):
        if not _module_hints.automatic:
            # Only parameters offload() moved (frozen then, unfrozen since): one outside the
            # model (a group added later) has no hint group, and unhinted use must not
            # share the hinted parameter class, so it stays where it is, unmanaged.
            late = [p for p in late if getattr(p, "_zeroalloc_adopted", False)]
        return _adoption.adopt(late, None, gradients, into) if late else []

    if stepper is not None:
        # Stepped in windows already (the automatic mode wrapped it when it was made, or an
        # earlier offload() did): this call's sizes apply from the next step, and the step
        # stays the earlier wrapper's; removing this handle puts the earlier sizes back.
        earlier = (stepper.window_bytes, stepper.overlap_bytes, stepper.adopt)
        stepper.configure(window_bytes, overlap_bytes, adopt)
        owner = weakref.ref(optimizer)

        def restore():
            # Only while it is still the optimizer's step: after the first handle's remove()
            # took it out, configuring it would bring a detached step back to life.
            held = owner()
            if held is not None and getattr(held, "_zeroalloc_stepper", None) is stepper:
                stepper.configure(*earlier)
                if earlier_choice is not None:
                    gradients.restore(earlier_choice)

        return OffloadHandle(hooks, None, None, hooked, restore=restore)
    original_step = None  # what remove() puts back as optimizer.step
    if optimizer is not None:
        original_step = original_of(optimizer, "step")
        optimizer.step = windowed_step(optimizer, optimizer.step, window_bytes, overlap_bytes,
                                       adopt=adopt, gradients=gradients)
        readopt_after_load(optimizer)
    return OffloadHandle(hooks, optimizer, original_step, hooked)


class ModelHooks:
    """The hooks offload() puts on a model, there once however many offload() calls name it
    (a model whose optimizer is made again, a second offload() of one optimizer): the use
    hints (unless the automatic mode's global hooks send them), the state-dict hook and the
    pins while loading. Hooks stacked per call would send each hint twice and pin twice.
    Each offload() holds them; the last holder's remove() takes them out. The first call's
    hint_group_bytes applies while they stay."""

    def __init__(self, hooks: list):
        self.hooks = hooks
        self.holders = 0


model_hooks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class ModelHooksHold:
    """One offload()'s hold on its model's hooks, removed with the handle's other hooks."""

    def __init__(self, model, shared: ModelHooks):
        self._model = weakref.ref(model)
        self._shared = shared
        shared.holders += 1

    def remove(self) -> None:
        shared, self._shared = self._shared, None
        if shared is None:  # removed already
            return
        shared.holders -= 1
        if shared.holders:
            return
        for hook in shared.hooks:
            hook.remove()
        model = self._model()
        if model is not None and model_hooks.get(model) is shared:
            del model_hooks[model]


def hold_model_hooks(model, hint_group_bytes: int) -> ModelHooksHold:
    shared = model_hooks.get(model)
    if shared is None:
        hooks = []
        if not _module_hints.automatic:  # else the automatic mode's global hooks hint it
            hooks += _module_hints.install_hint_hooks(model, hint_group_bytes)
        hooks.append(model.register_state_dict_post_hook(ModuleHook(copy_parameters_off_disk)))
        hooks += pin_during_load(model)  # Note [Parameters parked]: load_state_dict writes them
        shared = model_hooks[model] = ModelHooks(hooks)
    return ModelHooksHold(model, shared)


def enable_automatic_offload(window_bytes: int = 1 << 30, hint_group_bytes: int = 256 << 20,
                             overlap_bytes: int = 2 << 30,
                             gradient_class: "bool | str | None" = None) -> None:
    """Offload with no line changed in the training script (ZEROALLOC_OFFLOAD=host with the
    package's start-up hook): every optimizer created from now on has its parameters and
    states managed as offload() does, and global module hooks send the use hints, grouped
    as offload() groups them (Note [Hint groups])."""
    _settings.require_offload_engine()
    mode = mode_of(_settings.gradient_class_default() if gradient_class is None
                   else gradient_class)
    dtype = working_dtype(None)  # ZEROALLOC_MASTER_WEIGHTS, else the recipe's
    hints = _module_hints.AutomaticHints(hint_group_bytes)
    _module_hints.automatic.append(hints)
    torch.nn.modules.module.register_module_forward_pre_hook(hints.before)
    copy_parameters_off_disk_in_every_model()
    _module_hints.always_called(torch.nn.modules.module.register_module_forward_hook,
                                hints.after)
    original_init = torch.optim.Optimizer.__init__

    def init(self, params, defaults, *args, **kwargs):
        original_init(self, params, defaults, *args, **kwargs)
        if getattr(self, "_zeroalloc_adopted", False):
            return
        self._zeroalloc_adopted = True
        foreign = _adoption.storageless_parameter(self)
        if foreign is not None:  # FSDP2's DTensors: told once
            _adoption.warn_unmanaged_once(foreign)
            return
        if dtype is not None and not steps_by_param_groups(self):
            warnings.warn(f"zeroalloc: {type(self).__name__} does not step its param_groups "
                          "as torch.optim's optimizers do: its parameters keep their dtype "
                          "(master weights apply to the others)")
        elif dtype is not None:  # Note [Master weights]
            masters = MasterWeights(dtype)
            masters.make(self)
            if len(masters):
                masters.install(self)
                self._zeroalloc_masters = masters
        masters = masters_of(self)
        parameters = [p for group in self.param_groups for p in group["params"]]
        if masters is not None:  # the working copies are the model's parameters
            parameters = [masters.working(p) if masters.working(p) is not None else p
                          for p in parameters]
        gradients = GradientChoice(mode)  # Note [Gradients' class, decided]: per optimizer
        _adoption.adopt(parameters, self, gradients)
        self.step = windowed_step(self, self.step, window_bytes, overlap_bytes,
                                  adopt=lambda late, into: _adoption.adopt(late, None,
                                                                        gradients, into),
                                  gradients=gradients)
        readopt_after_load(self)

    torch.optim.Optimizer.__init__ = init
