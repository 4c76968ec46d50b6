"""ZeRO stage 3's parameters: each rank keeps the parameters it owns (stage 1's ownership)
and only an empty placeholder for the others, gathered from their owners while a module
uses them.

Note [Stage 3 by whole parameters]: a parameter that is not this rank's holds a tensor of
no elements (``parameter.data``; the Parameter object, its autograd identity and its
optimizer state slot stay). A module's forward pre-hook gathers its own parameters (not its
children's): the owner broadcasts those not gathered yet, a run of one owner's parameters
packed into one broadcast, and the others make what they receive the parameters' data; the module's forward
hook releases them again. The backward needs them too: a hook on each output of the module
(a tensor that requires a gradient) gathers the module's parameters when the gradient of
that output arrives, before the module's backward runs; a parameter is released once its
gradient has been accumulated (stage 2's hook, which then reduces it to its owner), and the
end of the backward releases what is left. Whether a parameter is gathered is the same on
every rank (the same hooks fire in the same order), so every rank calls the same broadcasts
in the same order. The saved tensors of the forward are the Parameter objects themselves,
so the backward reads whatever data they hold then: the gathered copy. After the step
nothing is broadcast: the owners' parameters are the only up-to-date ones, and the others
gather them at their next use. model.state_dict() gathers every parameter (on every rank,
as every rank must call it: a script that saves from rank 0 alone must call it on every
rank first) and returns CPU copies. The step lets go of any copy still gathered (a backward
that accumulated nothing, a forward that raised), since the owners' step makes it stale.
Limits: a parameter must be used inside the forward of a module that registers it (one
read by another module's forward, as F.linear(h, self.embedding.weight) in a parent, is
empty on the ranks that do not own it).

Note [Stage 3 under offload]: with zt.offload (or ZEROALLOC_OFFLOAD=host) before the
partition, the engine pages each rank's own parameters, as it pages any parameter, and the
others are no longer its to manage: their storage goes at the partition, and what a gather
makes of them lives with the activations for one use, so no hint may name it (the engine
would take that memory for a paged parameter's and move it without waiting for the kernels
that use it). So a parameter a rank does not own is taken out of offload's management (its
mark, which the module hints and the windowed step read, is cleared, and adoption passes it
over) and, when the partition ends, put back in the parameter class. An owner's gather
reads its parameters where they are, parked or on the host included, pinned there for the
broadcast (Note [Collectives on paged parameters]), and so does the copy model.state_dict()
makes of them; the module's own use hint then brings them back for its kernels as before.
"""

from __future__ import annotations

import contextlib

import torch

from zeroalloc import _group, _offload
from zeroalloc.torch import _adoption, _use_hints
from zeroalloc.torch._adoption import move_into_class
from zeroalloc.torch._transient import MARK, ModuleHook
from zeroalloc.torch._use_hints import current_stream


@contextlib.contextmanager
def pinned_where_they_are(parameters):
    """Note [Collectives on paged parameters]: under offload, a collective that writes a
    parameter (a broadcast from its owner) is not a use the engine was told of, so a move
    of its chunk (an eviction ahead of need takes a chunk whose last hinted use has ended)
    could copy the bytes before the collective's writes land and keep the stale copy. So the
    parameters on GPUs are pinned where they are (use_in_place) for the collectives, and the
    pins end on the streams they ran on; a parameter on the host is written there over
    PCIe. Memory the engine does not manage is left alone (the library ignores it)."""
    on_gpus = [p for p in parameters if p.is_cuda]
    if on_gpus:
        _use_hints.hint(_offload.use_in_place_many, on_gpus, 0)
    try:
        yield
    finally:
        if on_gpus:
            _use_hints.hint(_offload.use_ends_many, on_gpus, 0)


class ParameterShards:
    """The gathering and releasing of a partitioned model's parameters (Note [Stage 3 by
    whole parameters])."""

    def __init__(self, model: torch.nn.Module, owner_of: dict, rank: int, figures: dict):
        self.model = model
        self.owner_of = owner_of  # id(parameter) -> owning rank
        self.rank = rank
        self.figures = figures
        self.shapes = {}  # id(parameter) -> full shape
        self.gathered = set()  # ids of parameters every rank holds whole now
        self.hooks = []
        for module in model.modules():
            own = [p for p in module._parameters.values() if p is not None]
            if not own:
                continue
            # Note [Nothing of ours is pickled] in _transient.py
            self.hooks.append(module.register_forward_pre_hook(ModuleHook(self._before_forward)))
            self.hooks.append(module.register_forward_hook(ModuleHook(self._after_forward)))
        for parameter in model.parameters():
            self.shapes[id(parameter)] = parameter.shape
            if id(parameter) not in owner_of:
                raise ValueError("ZeRO stage 3 partitions the optimizer's parameters: the "
                                 f"model's parameter of shape {tuple(parameter.shape)} is not "
                                 "in the optimizer, so no rank would own it")
        # (A ModuleHook: PyTorch marks the hook with an attribute, which a method cannot take.)
        self.hooks.append(model.register_state_dict_post_hook(
            ModuleHook(self._gathered_state_dict)))
        # Note [Stage 3 under offload]: the others' parameters leave offload's management,
        # and no later adoption (a parameter unfrozen later, an offload() after this) takes
        # them; the automatic mode's hint groups are made again.
        self.unmanaged = [p for p in model.parameters()
                          if not self.owned(p) and getattr(p, "_zeroalloc_adopted", False)]
        for parameter in model.parameters():
            if not self.owned(parameter):
                parameter._zeroalloc_not_owned = True
        for parameter in self.unmanaged:
            parameter._zeroalloc_adopted = False
        _adoption.adoptions[0] += 1
        for parameter in model.parameters():
            self.release(parameter)

    def shape_of(self, parameter) -> torch.Size:
        return self.shapes[id(parameter)]

    def owned(self, parameter) -> bool:
        return self.owner_of[id(parameter)] == self.rank

    def paged(self, parameters) -> list:
        """Those of `parameters` this rank owns and offload pages, which a read must pin
        where they are (Note [Stage 3 under offload])."""
        return [p for p in parameters
                if self.owned(p) and getattr(p, "_zeroalloc_adopted", False)]

    def gather(self, parameters) -> None:
        """Every rank gets each parameter not gathered yet from its owner: one broadcast per
        run of one owner's parameters of one device and dtype (packed into one buffer when
        several)."""
        runs = []
        for parameter in parameters:
            if id(parameter) in self.gathered:
                continue
            owner = self.owner_of[id(parameter)]
            last = runs[-1][1][0] if runs else None
            if (last is not None and runs[-1][0] == owner and last.device == parameter.device
                    and last.dtype == parameter.dtype):
                runs[-1][1].append(parameter)
            else:
                runs.append((owner, [parameter]))
        for owner, members in runs:
            self._gather_run(owner, members)

    def _gather_run(self, owner: int, members: list) -> None:
        device = members[0].device
        stream = current_stream(device.index) if device.type == "cuda" else None
        sizes = [self.shape_of(p).numel() * p.element_size() for p in members]
        mine = owner == self.rank
        paged = self.paged(members)
        if len(members) == 1:  # in place on the owner, into a new tensor elsewhere
            parameter = members[0]
            data = parameter.data if mine else torch.empty(
                self.shape_of(parameter), dtype=parameter.dtype, device=device)
            with pinned_where_they_are(paged):
                _group.broadcast(data.data_ptr(), sizes[0], owner, stream)
            if not mine:
                parameter.data = data
        else:
            flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            if mine:
                with pinned_where_they_are(paged):
                    torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in members],
                              out=flat)
            _group.broadcast(flat.data_ptr(), flat.numel(), owner, stream)
            if not mine:  # views of the one buffer, which goes when the last is let go
                offset = 0
                for parameter, size in zip(members, sizes):
                    parameter.data = flat[offset:offset + size].view(parameter.dtype).view(
                        self.shape_of(parameter))
                    offset += size
        self.figures["gathers"] += 1
        self.figures["gathered_bytes"] += sum(sizes)
        for parameter in members:
            self.gathered.add(id(parameter))

    def release(self, parameter) -> None:
        """The parameter's gathered copy goes (the owner keeps its own)."""
        self.gathered.discard(id(parameter))
        if not self.owned(parameter) and parameter.data.numel() != 0:
            parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)

    def release_all(self) -> None:
        for parameter in self.model.parameters():
            self.release(parameter)

    def _module_parameters(self, module) -> list:
        return [p for p in module._parameters.values() if p is not None]

    def _before_forward(self, module, inputs) -> None:
        self.gather(self._module_parameters(module))

    def _after_forward(self, module, inputs, output):
        parameters = self._module_parameters(module)
        if torch.is_grad_enabled():
            for tensor in _tensors_in(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._regather(parameters))
        for parameter in parameters:
            self.release(parameter)
        return output

    def _regather(self, parameters):
        def hook(gradient):
            self.gather(parameters)
            return gradient
        return hook

    def _gathered_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        """The whole model's parameters, gathered from their owners, as CPU copies."""
        # Tied parameters appear under each of their names.
        for name, parameter in module.named_parameters(remove_duplicate=False):
            key = prefix + name
            if key not in state_dict:
                continue
            was_gathered = id(parameter) in self.gathered
            self.gather([parameter])
            with pinned_where_they_are(self.paged([parameter])):
                state_dict[key] = parameter.detach().to("cpu", copy=True)
            if not was_gathered:
                self.release(parameter)

    def remove(self) -> None:
        """Every rank gathers every parameter back for good (the partition ends)."""
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        self.gather(list(self.model.parameters()))
        # Note [Stage 3 under offload]: whole again, they are offload's again.
        for parameter in self.model.parameters():
            parameter.__dict__.pop("_zeroalloc_not_owned", None)
        with torch.no_grad():
            for parameter in self.unmanaged:
                parameter.data = move_into_class(parameter.data, "parameter")
                parameter._zeroalloc_adopted = MARK
        _adoption.adoptions[0] += 1
        self.unmanaged = []


def _tensors_in(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (list, tuple)):
        for each in value:
            yield from _tensors_in(each)
    elif isinstance(value, dict):
        for each in value.values():
            yield from _tensors_in(each)
