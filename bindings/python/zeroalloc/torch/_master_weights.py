"""Master weights: the model computes in bf16 while the optimizer steps fp32 copies that
the engine keeps wherever there is room (offload(master_weights=...),
ZEROALLOC_MASTER_WEIGHTS).

Note [Master weights]: with fp32 parameters under autocast, the residual stream, the norms
and whatever they save stay fp32, and the parameters themselves cost four bytes each on the
device, plus an autocast copy per step. DeepSpeed's bf16 mode (and ZeRO-Offload's footprint)
comes from another recipe: the model itself is bf16, and fp32 master copies of its
parameters, which only the optimizer reads, live with the optimizer's states. This module
gives offload() that recipe:

- each fp32 parameter of the optimizer's param_groups becomes a bf16 working copy (the
  same Parameter object, its data cast; the model's hooks, names and modules are untouched),
  in the parameter class where use hints page it as before;
- its fp32 master (the original values) takes its place in param_groups and in the
  optimizer's state, in the optimizer-state class, so the engine places masters as it
  places the moments: on the device while there is room, on the host (and disk) under
  pressure;
- the windowed step steps masters: on the device, a window's working gradients are cast to
  fp32 for the optimizer's own step and the updated masters rounded back into the working
  copies, bit for bit what the same recipe in plain PyTorch computes; on the host (Note
  [Host windows] in _host_step.py), the bf16 gradients cross PCIe at half the bytes, the
  CPUs step the masters where they are and write the bf16 copies into pinned buffers, and
  only those cross back;
- optimizer.zero_grad() clears the working copies' gradients too; the optimizer's
  state_dict carries the masters (``zeroalloc_master_weights``, in param_groups order) and
  its load_state_dict puts them back, into the working copies as well; loading a model's
  state dict (bf16 or fp32) sets the masters from what it loaded, rounded as the working
  copies hold it, until the optimizer's state dict brings the fp32 values.

Training this way is not bit for bit fp32 training under autocast: activations and
gradients are bf16, as with DeepSpeed's bf16 mode. Inputs the model reads as floats must be
bf16 too (or the forward run under autocast). Parameters already bf16, or not floating
point, are stepped as they are, with no master.
"""

from __future__ import annotations

import weakref

import torch

from zeroalloc import _offload, _stats
from zeroalloc._library import ZeroallocError
from zeroalloc.torch import _settings, _use_hints
from zeroalloc.torch._transient import MARK, ModuleHook
from zeroalloc.torch._weak_methods import BoundWeakly, original_of, put_back

STATE_KEY = "zeroalloc_master_weights"
NAMES = ("bf16", "bfloat16")  # torch.bfloat16 is read at use: the start-up hook imports this
                              # module while torch itself is importing


def finish_every_behind() -> None:
    """Note [The host step finishes behind the forward] (_host_step.py): what reads or
    writes masters, working copies or their gradients first lets the CPUs finish."""
    from zeroalloc.torch._host_step import finish_every_behind as finish  # torch imported
    finish()


def working_dtype(choice) -> "torch.dtype | None":
    """offload()'s `master_weights` as a dtype: None or False (when None,
    ZEROALLOC_MASTER_WEIGHTS, else the recipe's), True or "bf16" or torch.bfloat16."""
    if choice is None:
        choice = _settings.master_weights()
    if choice is False or choice in ("none", "0", "off", "no", "false"):
        return None
    if choice is True or choice is torch.bfloat16:
        return torch.bfloat16
    if isinstance(choice, str) and choice.lower() in NAMES:
        return torch.bfloat16
    raise ZeroallocError(f"master_weights={choice!r} is not a working precision zeroalloc "
                         "trains in: use True, 'bf16' or torch.bfloat16 (or None/False for "
                         "none)")


def fill(destination, source) -> None:
    """destination.copy_(source), each managed one's first touch hinted where it is."""
    pinned = [t for t in (destination, source) if t.is_cuda and t.numel() > 0]
    if pinned:
        _use_hints.hint(_offload.use_in_place_many, pinned, 0)
    try:
        destination.copy_(source)
    finally:
        if pinned:
            _use_hints.hint(_offload.use_ends_many, pinned, 0)


class MasterWeights:
    """The masters of one optimizer and their working copies (Note [Master weights])."""

    def __init__(self, dtype: "torch.dtype"):
        self.dtype = dtype
        self.pairs: dict = {}  # id(master) -> (master, working parameter)
        self.working_ids: set = set()
        self.hooks: list = []
        self.original_zero_grad = None

    def __len__(self) -> int:
        return len(self.pairs)

    def working(self, master):
        """The working copy of `master`, or None (a parameter stepped as it is)."""
        pair = self.pairs.get(id(master))
        return pair[1] if pair is not None else None

    def gradient(self, parameter):
        """What the step reads as `parameter`'s gradient: a master's is its working copy's."""
        pair = self.pairs.get(id(parameter))
        return pair[1].grad if pair is not None else parameter.grad

    # -- set-up ----------------------------------------------------------------------------
    def make(self, optimizer) -> None:
        """Masters for the fp32 parameters of optimizer's param_groups, in their places, and
        the parameters turned into working copies. A parameter that is the working copy of
        another optimizer's master (the optimizer made again, say) gets a master of its own
        with that master's values. Checks every parameter before it changes any."""
        from zeroalloc.torch._optimizer_step import steps_by_param_groups
        if not steps_by_param_groups(optimizer):
            # Its step would not read the masters' gradients where the windowed step puts
            # them (a closure's backward, an inner optimizer's own parameters).
            raise ZeroallocError(f"master weights need an optimizer that steps its "
                                 f"param_groups as torch.optim's do; "
                                 f"{type(optimizer).__name__} does not (LBFGS, a "
                                 "ZeroRedundancyOptimizer or a step of its own)")
        chosen = []  # (group's params, index, parameter, an existing master or None)
        for group in optimizer.param_groups:
            params = group["params"]
            for index, parameter in enumerate(params):
                if id(parameter) in self.working_ids:
                    continue
                existing = existing_master(parameter)
                if existing is None and parameter.dtype != torch.float32:
                    continue
                if existing is None and getattr(parameter, "_zeroalloc_adopted", False):
                    raise ZeroallocError(
                        "master weights must be made before zeroalloc manages the "
                        "parameters: pass master_weights to the first offload() of this "
                        "model, or set ZEROALLOC_MASTER_WEIGHTS for the automatic mode")
                chosen.append((params, index, parameter, existing))
        with torch.no_grad():
            for params, index, parameter, existing in chosen:
                if existing is not None:
                    master = self.copy_of(existing)
                else:
                    master = self.master_of(parameter)
                params[index] = master
                if parameter in optimizer.state:
                    optimizer.state[master] = optimizer.state.pop(parameter)
                self.pairs[id(master)] = (master, parameter)
                self.working_ids.add(id(parameter))

    def master_of(self, parameter):
        """The fp32 master of `parameter` (its values, in the optimizer-state class), with
        the parameter cast to the working dtype in place."""
        if parameter.is_cuda:
            with _stats.allocation_class("optimizer_state"):
                master = torch.empty_like(parameter, memory_format=torch.preserve_format)
            fill(master, parameter.data)
        else:
            master = parameter.detach().clone()
        mark(master)
        parameter.data = parameter.data.to(self.dtype)
        if parameter.grad is not None:
            parameter.grad = parameter.grad.to(self.dtype)
        return master

    def copy_of(self, existing):
        """A master of this optimizer's for a working copy that has one already: its values."""
        if existing.is_cuda:
            with _stats.allocation_class("optimizer_state"):
                master = torch.empty_like(existing, memory_format=torch.preserve_format)
            fill(master, existing.detach())
        else:
            master = existing.detach().clone()
        mark(master)
        return master

    def install(self, optimizer) -> None:
        """zero_grad clears the working gradients too; the optimizer's state dicts carry
        the masters."""
        self.original_zero_grad = original_of(optimizer, "zero_grad")
        masters = self

        def zero_grad(self, set_to_none: bool = True):
            if not set_to_none:  # zeroed in place: after the host's copies of them
                finish_every_behind()
            if masters.original_zero_grad is not None:
                masters.original_zero_grad(set_to_none)
            else:
                type(self).zero_grad(self, set_to_none)
            masters.zero_working(set_to_none)

        optimizer.zero_grad = BoundWeakly(zero_grad, optimizer)
        self.hooks.append(optimizer.register_state_dict_post_hook(self.save))
        self.hooks.append(optimizer.register_load_state_dict_pre_hook(self.load))
        every.add(self)

    def install_model_hook(self, model) -> list:
        """Loading a state dict into the model, or into any module of it (torch runs the
        post-hooks of every module a load reaches), sets the masters whose working copies it
        changed. Holds this weakly: the optimizer holds it."""
        owner = weakref.ref(self)

        def loaded(module, incompatible):
            masters = owner()
            if masters is not None:
                masters.refresh(module, recurse=False)

        def reading(module, prefix, keep_vars):  # the working copies, once written
            finish_every_behind()

        holders = [each for each in model.modules()
                   if any(True for _ in each.parameters(recurse=False))]
        # Note [Nothing of ours is pickled]
        loaded, reading = ModuleHook(loaded), ModuleHook(reading)
        return ([each.register_load_state_dict_post_hook(loaded) for each in holders]
                + [each.register_state_dict_pre_hook(reading) for each in holders])

    # -- the step --------------------------------------------------------------------------
    def members(self, masters) -> set:
        """The ids whose accumulations count for a step of `masters`: theirs and their working
        copies'."""
        found = set()
        for master in masters:
            found.add(id(master))
            working = self.working(master)
            if working is not None:
                found.add(id(working))
        return found

    def begin_step(self, window, stream) -> list:
        """Before the optimizer's own step of `window` on the device: each master's gradient is
        its working gradient cast to fp32 (with the step's temporaries). Returns the working
        copies to write after."""
        written = []
        for master in window:
            pair = self.pairs.get(id(master))
            if pair is None:
                continue
            working = pair[1]
            if working.grad is not None:
                with _stats.allocation_class("other"):
                    master.grad = working.grad.to(torch.float32)
            written.append((master, working))
        if written and hinted(written[0][1]):
            _use_hints.begin([w for _, w in written], stream)
        return written

    def end_step(self, written: list, stream, stepped: bool = True) -> None:
        """After it: the updated masters rounded into their working copies (when `stepped`),
        and the fp32 gradients dropped."""
        try:
            if stepped:
                with torch.no_grad():
                    for master, working in written:
                        working.copy_(master)
        finally:
            for master, _ in written:
                master.grad = None
            if written and hinted(written[0][1]):
                _use_hints.end([w for _, w in written], stream)

    def zero_working(self, set_to_none: bool) -> None:
        for _, working in self.pairs.values():
            if working.grad is None:
                continue
            if set_to_none:
                working.grad = None
            else:
                if working.grad.grad_fn is not None:
                    working.grad.detach_()
                else:
                    working.grad.requires_grad_(False)
                working.grad.zero_()

    # -- state dicts -----------------------------------------------------------------------
    def save(self, optimizer, state_dict: dict) -> dict:
        """The masters, in the order of the state dict's parameter indices (None for a
        parameter with no master); copied to the CPU where copied_off_disk copies states
        (on disk now, or anywhere with the disk tier configured)."""
        from zeroalloc.torch._state_dict import cpu_copy_if_on_disk
        finish_every_behind()  # Note [The host step finishes behind the forward]
        wherever = _settings.disk_tier()
        saved = []
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if id(parameter) not in self.pairs:
                    saved.append(None)
                    continue
                copied = cpu_copy_if_on_disk(parameter, wherever) if parameter.is_cuda else None
                saved.append(copied if copied is not None else parameter.detach())
        state_dict[STATE_KEY] = saved
        return state_dict

    def load(self, optimizer, state_dict: dict):
        """Before the optimizer loads its states: the masters (and working copies) take the
        saved masters' values. A state dict without them (saved without master weights)
        leaves the masters as the working copies last set them."""
        finish_every_behind()  # Note [The host step finishes behind the forward]
        saved = state_dict.get(STATE_KEY)
        if saved is None:
            return None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if len(saved) != len(params):
            raise ZeroallocError(f"the state dict's master weights cover {len(saved)} "
                                 f"parameters, the optimizer has {len(params)}: it was saved "
                                 "from another model or optimizer")
        for parameter, value in zip(params, saved):  # all checked before any is written
            if value is not None and id(parameter) in self.pairs and value.shape != parameter.shape:
                raise ZeroallocError(f"a saved master weight has shape {tuple(value.shape)}, "
                                     f"its parameter {tuple(parameter.shape)}: the state dict "
                                     "was saved from another model or optimizer")
        with torch.no_grad():
            for parameter, value in zip(params, saved):
                if value is None or id(parameter) not in self.pairs:
                    continue
                fill(parameter, value.to(parameter.dtype))
                working = self.pairs[id(parameter)][1]
                fill(working, parameter)
        state_dict = dict(state_dict)
        del state_dict[STATE_KEY]
        return state_dict

    def refresh(self, module, recurse: bool = True) -> None:
        """After a load_state_dict into `module`: each master whose working copy the load
        changed (it no longer holds the master rounded) takes the working copy's value. The
        others keep their fp32 bits (a partial load, strict=False)."""
        loaded = {id(p) for p in module.parameters(recurse=recurse)}
        finish_every_behind()  # Note [The host step finishes behind the forward]
        with torch.no_grad():
            for master, working in self.pairs.values():
                if id(working) not in loaded:
                    continue
                pinned = [t for t in (master, working) if t.is_cuda and t.numel() > 0]
                if pinned:
                    _use_hints.hint(_offload.use_in_place_many, pinned, 0)
                try:
                    if not torch.equal(master.to(working.dtype), working):
                        master.copy_(working)
                finally:
                    if pinned:
                        _use_hints.hint(_offload.use_ends_many, pinned, 0)

    # -- undone ----------------------------------------------------------------------------
    def remove(self, optimizer) -> None:
        """Back to fp32 parameters (the masters' values) in param_groups and the state; the
        working gradients cast back."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        finish_every_behind()  # Note [The host step finishes behind the forward]
        every.discard(self)
        put_back(optimizer, "zero_grad", self.original_zero_grad)
        with torch.no_grad():
            for group in optimizer.param_groups:
                params = group["params"]
                for index, master in enumerate(params):
                    pair = self.pairs.get(id(master))
                    if pair is None:
                        continue
                    working = pair[1]
                    if master in optimizer.state:
                        optimizer.state[working] = optimizer.state.pop(master)
                    if working.is_cuda:
                        with _stats.allocation_class("parameter"):
                            fp32 = torch.empty_like(master)
                        fill(fp32, master.detach())
                    else:
                        fp32 = master.detach().clone()
                    grad = working.grad
                    working.grad = None
                    working.data = fp32
                    if grad is not None:
                        working.grad = grad.to(torch.float32)
                    params[index] = working
        self.pairs, self.working_ids = {}, set()


def hinted(tensor) -> bool:
    """Whether uses of `tensor` are hinted: the windowed step's rule (a GPU's)."""
    from zeroalloc.torch import _optimizer_step
    return _optimizer_step.on_gpu(tensor.device)


def mark(master) -> None:
    """Marked as offload() marks what it manages: never adopted as a parameter, never hooked
    (its working copy is)."""
    master._zeroalloc_adopted = MARK
    master._zeroalloc_hooked = MARK
    master._zeroalloc_master = MARK


def existing_master(working):
    """The master another live optimizer keeps for `working`, or None."""
    for masters in tuple(every):
        if id(working) in masters.working_ids:
            for master, each in masters.pairs.values():
                if each is working:
                    return master
    return None


def masters_of(optimizer) -> "MasterWeights | None":
    return getattr(optimizer, "_zeroalloc_masters", None)


#: Every installed MasterWeights, for the automatic mode, which knows no model: its
#: load_state_dict wrapper refreshes the masters of whatever module was loaded.
every: "weakref.WeakSet" = weakref.WeakSet()


def refresh_every(module) -> None:
    for masters in tuple(every):
        masters.refresh(module)
