"""zeroalloc for PyTorch.

``install()`` makes zeroalloc PyTorch's CUDA allocator for the whole process (two lines in a
script); ``mem_pool()`` routes only the allocations made inside ``torch.cuda.use_mem_pool``
through zeroalloc and leaves PyTorch's own allocator, statistics and cudnn for the rest.
"""

from __future__ import annotations

import torch

import contextlib
import functools
import inspect
import threading
import time
import types
import warnings
import weakref
from collections.abc import Mapping
from typing import Iterable

from zeroalloc import _offload
from zeroalloc._library import ZeroallocError, function_address, library_path
from zeroalloc._stats import allocation_class, raw_stats, room

_allocator = None


def _pluggable_allocator():
    """One CUDAPluggableAllocator over libzeroalloc.so with all four hooks set."""
    global _allocator
    if _allocator is None:
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            str(library_path()), "zeroalloc_torch_malloc", "zeroalloc_free")
        hooks = allocator.allocator()
        hooks.set_init_fn(function_address("zeroalloc_init"))
        hooks.set_reset_fn(function_address("zeroalloc_empty_cache"))
        hooks.set_memory_fraction_fn(function_address("zeroalloc_set_memory_fraction"))
        hooks.set_record_stream_fn(function_address("zeroalloc_record_stream"))
        _allocator = allocator
    return _allocator


def install() -> None:
    """Switches PyTorch to zeroalloc for every CUDA allocation of this process.

    Must run before any CUDA work (PyTorch allows the swap only then, once per process).
    Afterwards torch.cuda.memory_stats and memory_snapshot are unavailable (PyTorch's own
    allocator is gone): use zeroalloc.memory_stats() and zeroalloc.memory_summary().
    """
    if torch.cuda.is_initialized():
        raise ZeroallocError(
            "zeroalloc.torch.install() must run before any CUDA work, and CUDA is already "
            "initialised in this process (by torch.cuda.set_device, a tensor on a GPU, ...). "
            "Call it at the top of the script, or use zeroalloc.torch.mem_pool() to route "
            "chosen tensors instead.")
    torch.cuda.memory.change_current_allocator(_pluggable_allocator())
    _installed[0] = True


#: Whether install() made zeroalloc PyTorch's allocator in this process.
_installed = [False]


def installed() -> bool:
    """Whether install() has made zeroalloc PyTorch's allocator in this process."""
    return _installed[0]


def mem_pool() -> "torch.cuda.MemPool":
    """A torch.cuda.MemPool whose segments come from zeroalloc:
    ``with torch.cuda.use_mem_pool(zt.mem_pool()): ...``"""
    return torch.cuda.MemPool(_pluggable_allocator().allocator())


# ---- Offload ---------------------------------------------------------------------------------

def offload_tensor(tensor: "torch.Tensor", wait: bool = True) -> None:
    """Moves the tensor's storage to pinned host memory; its address, and every view of it,
    stay valid (kernels reach it over PCIe until it comes back). With `wait=False`, queue no
    work on the tensor until `residency(tensor)` stops answering "moving". Memory it shares
    a chunk with, in use by a hinted module or optimizer step, stays on the device. An
    optimizer state that the last windowed step kept in device scratch (Note [Overlapping
    the step]) is written back first, and its own tensor is moved."""
    _offload.offload_pointer(_home_of(tensor).untyped_storage().data_ptr(), wait)


def fetch_tensor(tensor: "torch.Tensor", wait: bool = True) -> None:
    """Brings the tensor's storage back to device memory (a kept optimizer state: its own
    tensor's, as offload_tensor)."""
    _offload.fetch_pointer(_home_of(tensor).untyped_storage().data_ptr(), wait)


def residency(tensor: "torch.Tensor") -> str:
    """Where the tensor's storage is: "device", "host", "split" or "moving" (a kept optimizer
    state: its own tensor's, as offload_tensor)."""
    return _offload.residency_of(_home_of(tensor).untyped_storage().data_ptr())


#: id(tensor in a state dict) -> the windowed step that kept it in scratch after a step.
#: Weak: a dropped optimizer takes its step, its states and their scratch along.
_kept_states: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _home_of(tensor):
    """The tensor itself, or for an optimizer state kept in scratch, its own tensor, once
    written back (the scratch is not the optimizer-state class's, and moving it would race
    the write-back)."""
    stepper = _kept_states.get(id(tensor))
    if stepper is None:
        return tensor
    for entry in stepper.kept:
        if entry[0].get(entry[1]) is tensor:
            home = entry[2]
            stepper.write_back_kept(wait=True)
            return home
    return tensor


def _stream(device_index: "int | None" = None) -> int:
    """The current stream of a device (the current device when none is named), as an
    integer: the hooks ask for it once per module, and torch.cuda.current_stream() builds a
    Stream object each time."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return torch.cuda.current_stream(device_index).cuda_stream
    return raw(torch._C._cuda_getDevice() if device_index is None else device_index)


def _pointers(tensors: Iterable["torch.Tensor"]) -> list:
    return [tensor.untyped_storage().data_ptr() for tensor in tensors]


def _hint(call, tensors: Iterable["torch.Tensor"], stream: int) -> None:
    """One library call per device of the tensors, each fenced on that device's current
    stream unless `stream` is given: a model split over several GPUs in one process runs
    each part on its own device's stream, and a fence on another device's stream would let
    the engine move a chunk that the part's kernels still read."""
    tensors = tensors if isinstance(tensors, (list, tuple)) else list(tensors)
    if stream or not tensors:
        call(_pointers(tensors), stream or _stream())
        return
    index = tensors[0].get_device()  # -1 for a tensor on the CPU
    if all(tensor.get_device() == index for tensor in tensors):
        call(_pointers(tensors), _stream(index if index >= 0 else None))
        return
    by_device: dict = {}
    for tensor in tensors:
        by_device.setdefault(tensor.get_device(), []).append(tensor)
    for index, part in by_device.items():
        call(_pointers(part), _stream(index if index >= 0 else None))


def _begin(tensors: Iterable["torch.Tensor"], stream: int = 0) -> None:
    """Use-begins hints for the tensors, in one call into the library per device."""
    _hint(_offload.use_begins_many, tensors, stream)


def _end(tensors: Iterable["torch.Tensor"], stream: int = 0) -> None:
    _hint(_offload.use_ends_many, tensors, stream)


def _move_into_class(tensor: "torch.Tensor", name: str) -> "torch.Tensor":
    with allocation_class(name):
        moved = torch.empty_like(tensor)
    moved.copy_(tensor)
    return moved


class _BoundWeakly:
    """Note [No cycles through the optimizer]: a method stored on its own instance (the
    windowed step, the state-dict wrappers) as a bound method would hold the instance that
    holds it: a cycle, so that a dropped model and optimizer, and their device memory, went
    only when the cycle collector ran, not at `del`. This holds the instance weakly and
    answers __func__ and __self__ as a bound method does (LR schedulers wrap a step through
    __func__, with a weak reference of their own); other attributes are the function's."""

    # No __dict__ of its own: functools.wraps and attribute lookups (_zeroalloc_windowed,
    # _wrapped_by_lr_sched) reach the function's, as they do through a bound method.
    __slots__ = ("__func__", "_instance", "__weakref__")

    def __init__(self, function, instance):
        self.__func__ = function
        self._instance = weakref.ref(instance)

    @property
    def __self__(self):
        return self._instance()

    @property
    def __signature__(self):  # without `self`, as a bound method's
        instance = self._instance()
        if instance is None:
            return inspect.signature(self.__func__)
        return inspect.signature(types.MethodType(self.__func__, instance))

    def __getattr__(self, name):
        if name in ("__func__", "_instance"):  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.__func__, name)

    def __call__(self, *args, **kwargs):
        instance = self._instance()
        if instance is None:
            raise ReferenceError("zeroalloc: the optimizer this method belonged to is gone")
        return self.__func__(instance, *args, **kwargs)


def _bound_to(method, instance) -> bool:
    """Whether `method` is a method of `instance` (bound, or weakly bound)."""
    return getattr(method, "__self__", None) is instance and hasattr(method, "__func__")


def _unbound(method, instance):
    """`method` as a function of the instance, holding no reference to `instance` (Note [No
    cycles through the optimizer]): a method bound to it gives its function; anything else
    (a wrapper an LR scheduler stored on it, which holds it weakly) is called as it is."""
    if _bound_to(method, instance):
        return method.__func__
    return lambda _instance, *args, **kwargs: method(*args, **kwargs)


def _original_of(instance, name: str):
    """What instance.name is now, to be put back later by _put_back without a reference to
    `instance`: None for the class's own method, else the attribute (one bound to the
    instance is held weakly bound)."""
    current = getattr(instance, name)
    if _bound_to(current, instance):
        if name not in instance.__dict__:
            return None
        return _BoundWeakly(current.__func__, instance)
    return current


def _put_back(instance, name: str, original) -> None:
    """Undoes a wrap of instance.name: `original` is what _original_of said."""
    if original is None:
        instance.__dict__.pop(name, None)
    else:
        setattr(instance, name, original)


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
        _unmark_hooked(self._hooked)  # a later offload() hooks them again
        self._hooked = []
        if self._restore is not None:
            self._restore()
            self._restore = None
        if self._optimizer is not None:
            optimizer = self._optimizer
            stepper = getattr(optimizer, "_zeroalloc_stepper", None)
            if stepper is not None:  # states it kept or staged go home first
                stepper.settle()
                _overlapping.discard(stepper)
                for hook in stepper.late_hooks:
                    hook.remove()
                _unmark_hooked(stepper.late_hooked)
                del optimizer._zeroalloc_stepper
            _put_back(optimizer, "step", self._original_step)
            for name in ("load_state_dict", "state_dict"):
                wrapper = optimizer.__dict__.get(name)
                function = getattr(wrapper, "__func__", None)
                if function is not None and hasattr(function, "_zeroalloc_original"):
                    _put_back(optimizer, name, function._zeroalloc_original)
            self._optimizer = None
            self._original_step = None


def _unmark_hooked(references: list) -> None:
    """Clears the marks of the hooks taken out: (weak reference to a parameter, mark)."""
    for reference, mark in references:
        parameter = reference()
        if parameter is not None:
            parameter.__dict__.pop(mark, None)


def _setting(name: str, fallback: str) -> str:
    """The variable `name` as the environment holds it now, checked by the library's own
    parser, else its default (asks no device for anything). The library read its settings
    once, at its first call: change them before that, not after."""
    from zeroalloc._library import library, read_json
    report = read_json(library().zeroalloc_options_json)
    if not report.get("valid", True):
        raise ZeroallocError(report.get("error") or f"{name} could not be read")
    for option in report.get("options", []):
        if option.get("name") == name:
            return (option.get("value") or option.get("default") or fallback).strip().lower()
    return fallback


def _offload_setting() -> str:
    """ZEROALLOC_OFFLOAD, checked as the library checks it."""
    return _setting("ZEROALLOC_OFFLOAD", "none")


def gradient_class_default() -> bool:
    """ZEROALLOC_OFFLOAD_GRADIENTS, checked as the library checks it (the library rejects a
    value that is not a yes or a no at start-up): what offload() and the automatic mode do
    with gradients when `gradient_class` is not given."""
    return _setting("ZEROALLOC_OFFLOAD_GRADIENTS", "0") in ("1", "true", "yes", "on")


def _require_offload_engine() -> None:
    if _offload_setting() != "host":
        raise ZeroallocError(
            "zeroalloc.torch.offload() needs the offload engine: set ZEROALLOC_OFFLOAD=host "
            "in the environment before the process starts (and zeroalloc as PyTorch's "
            "allocator: zeroalloc.torch.install() or ZEROALLOC_TORCH=zeroalloc)")


#: Bumped whenever a parameter is adopted: the automatic mode's per-module group decisions,
#: made from the managed bytes under a module, are stale after that.
_adoptions = [0]


def _adopt(parameters, optimizer=None, gradient_class: bool = False,
           hooked: "list | None" = None) -> list:
    """Moves parameters (and the optimizer's existing states) into their allocation classes
    and hints the end of each parameter's backward use; with `gradient_class`, gradients go
    into theirs too (Note [Gradients' class]). Returns the hooks; appends the parameters it
    hooked to `hooked`, each as (parameter, the mark of its hook). A parameter hooked
    before gets only what it lacks: the gradient class's hook when asked for now. Of the
    optimizer's states only those the windowed step pins and hints move (a scalar step
    count on the device stays with the activations: unhinted use must not share a hinted
    class)."""
    hooks = []
    with torch.no_grad():
        for parameter in parameters:
            if not parameter.is_cuda:
                continue
            if not getattr(parameter, "_zeroalloc_adopted", False):
                parameter.data = _move_into_class(parameter.data, "parameter")
                parameter._zeroalloc_adopted = True
                _adoptions[0] += 1
            if not parameter.requires_grad:
                continue
            if not getattr(parameter, "_zeroalloc_hooked", False):
                parameter._zeroalloc_hooked = True
                if hooked is not None:
                    hooked.append((parameter, "_zeroalloc_hooked"))
                hooks.append(parameter.register_post_accumulate_grad_hook(_end_backward))
            if gradient_class and not getattr(parameter, "_zeroalloc_gradient_hooked", False):
                parameter._zeroalloc_gradient_hooked = True
                if hooked is not None:
                    hooked.append((parameter, "_zeroalloc_gradient_hooked"))
                if parameter.grad is not None and not parameter.grad.is_sparse:
                    parameter.grad = _move_into_class(parameter.grad, "gradient")
                hooks.append(parameter.register_hook(_gradient_into_class(parameter)))
        if optimizer is not None:
            for state in optimizer.state.values():
                for key, value in list(state.items()):
                    if _is_paged_state(value):
                        state[key] = _move_into_class(value, "optimizer_state")
    return hooks


def _gradient_into_class(parameter):
    """Note [Gradients' class]: autograd allocates a parameter's gradient in the kernel that
    computes it, on its own thread and in the activations' class, and the accumulation into
    an empty `.grad` adopts that tensor as it is. So the hook on the parameter copies the
    first gradient of a backward into the gradient class (the accumulation then adopts the
    copy); later ones, with `.grad` there, are added into it in place. The copy costs each
    gradient's bytes once a step, read and written on the device. In their own class,
    gradients are what pressure moves last, and only when an allocation would fail (Note
    [Residency policy]); in the activations' class they could not move at all."""
    owner = weakref.ref(parameter)

    def hook(gradient):
        held = owner()
        # Under create_graph the accumulation copies whatever it gets: nothing to gain.
        if (held is None or held.grad is not None or gradient.is_sparse
                or torch.is_grad_enabled()):
            return None
        with allocation_class("gradient"):
            # The parameter's strides: the accumulation adopts only a gradient laid out like
            # its parameter, and copies any other (in the activations' class).
            moved = torch.empty_like(held, memory_format=torch.preserve_format)
        moved.copy_(gradient)
        return moved

    return hook


def _managed(module) -> list:
    """The module's own parameters that zeroalloc manages (moved into the parameter class).
    Read from the module's parameter dict: the hooks run twice per module per step, and
    parameters(recurse=False) walks a generator with a memo set each time."""
    return [p for p in module._parameters.values()
            if p is not None and getattr(p, "_zeroalloc_adopted", False)]


def _output_tensors(output, found: list, depth: int = 0) -> list:
    """The tensors that require grad in a module's output: a tensor, or tensors inside
    tuples, lists and mappings (a transformers ModelOutput is a mapping), a few levels deep."""
    if torch.is_tensor(output):
        if output.requires_grad and output.grad_fn is not None:  # a leaf's hook would stay
            found.append(output)
    elif depth < 4 and isinstance(output, (tuple, list, Mapping)):
        for each in (output.values() if isinstance(output, Mapping) else output):
            _output_tensors(each, found, depth + 1)
    return found


def _begin_backward(own: list) -> None:
    """Note [Backward uses]: a parameter's backward use begins when the backward reaches the
    first module using it (a hook on that module's output gradient) and ends when its
    gradient is accumulated (after every use of it in the graph). So it begins once per
    backward: a module called twice, a weight tied between two modules and a layer
    recomputed under checkpointing would begin it again. And what the backward began and
    did not accumulate into (frozen parameters, experts no token reached, autograd.grad,
    the outer backward around a reentrant checkpoint's inner one) ends when that backward
    ends: open, it would pin its chunks until the step's end, or for good outside training."""
    if _overlapping:
        _module_hint(own, False)
    task = _graph_task()
    if task is None:  # a PyTorch without graph task ids: as before, one begin per hook
        _begin(own)
        return
    with _backward_lock:  # the autograd threads of several devices may begin one task
        begun = _backward_open.get(task)
        if begun is None:
            begun = _backward_open[task] = {}
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda task=task: _close_backward(task))
        fresh = [p for p in own if id(p) not in begun]
        for parameter in fresh:
            begun[id(parameter)] = weakref.ref(parameter)  # a dropped model must not wait
    if fresh:  # outside the lock: the hint may wait for a fetch
        _begin(fresh)


def _end_backward(parameter) -> None:
    """The post-accumulate-grad hook: ends the backward use this backward began."""
    task = _graph_task()
    for stepper in tuple(_overlapping):
        if id(parameter) in stepper.members:
            stepper.accumulated(task)
    if task is None:
        if not hasattr(torch._C, "_current_graph_task_id"):
            _end((parameter,))  # no task ids: uses were begun untracked
        return
    begun = _backward_open.get(task)
    if begun is not None and begun.pop(id(parameter), None) is not None:
        _end((parameter,))


def _close_backward(task) -> None:
    """At the end of a backward: ends the uses it began and never accumulated into."""
    left = [parameter for parameter in (reference() for reference in
                                        _backward_open.pop(task, {}).values())
            if parameter is not None]
    if left:
        _end(left)


#: graph task id -> {id(parameter): weak reference to it} begun in that backward, not yet
#: ended.
_backward_open: dict = {}
_backward_lock = threading.Lock()


def _closing_backward(original):
    """torch.autograd.backward, ending the uses begun by a backward that raised (Note
    [Backward uses]): autograd runs a backward's end callback only when it succeeds, so its
    open uses would pin their chunks until the next step boundary, or for good where no
    optimizer steps (an out-of-memory retry loop, offload(model) alone). The tasks closed are
    those begun during this call, inner ones included."""

    def backward(*args, **kwargs):
        before = _backward_open.copy()
        try:
            return original(*args, **kwargs)
        except BaseException:
            for task in [task for task in _backward_open.copy() if task not in before]:
                try:
                    _close_backward(task)
                except Exception:  # the backward's own error is the one to see
                    pass
            raise

    functools.update_wrapper(backward, original)
    backward._zeroalloc_closing = True
    return backward


def _guard_backward() -> None:
    """Installs _closing_backward once (Tensor.backward calls torch.autograd.backward)."""
    autograd = getattr(torch, "autograd", None)
    original = getattr(autograd, "backward", None)
    if original is not None and not getattr(original, "_zeroalloc_closing", False):
        autograd.backward = _closing_backward(original)


def _graph_task():
    current = getattr(torch._C, "_current_graph_task_id", None)
    task = current() if current is not None else -1
    return None if task == -1 else task


def _hint_backward(own: list, output) -> None:
    """Backward of a module begins when the first gradient of its outputs arrives: one
    use-begins per backward, whichever output it comes through."""
    tensors = _output_tensors(output, [])
    if len(tensors) > 1:
        try:  # once per backward, on the first of the outputs' gradients (PyTorch 2.2 on)
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grad: _begin_backward(own), mode="any")
            return
        except (AttributeError, TypeError):
            pass  # then the first output's gradient, as for a single output
    if tensors:
        tensors[0].register_hook(lambda grad, own=own: (_begin_backward(own), grad)[1])


def _before_forward(module, _inputs) -> None:
    own = _managed(module)
    if own:
        if _overlapping:
            _module_hint(own, True)
        _begin(own)


def _after_forward(module, _inputs, output) -> None:
    own = _managed(module)
    if not own:
        return
    _end(own)
    _hint_backward(own, output)


class _HintGroup:
    """Modules hinted as one (Note [Hint groups]): `top`, and the modules in `members` whose
    own parameters it hints; `covered` are the ids of the modules whose hints it makes
    (its whole subtree, or `top` alone when only `top`'s own parameters are hinted). Holds
    its modules weakly: the automatic mode keeps groups in a table keyed by module."""

    _all: "weakref.WeakSet" = weakref.WeakSet()

    def __init__(self, top, members, whole_subtree: bool):
        self.top = weakref.ref(top)
        self.members = [weakref.ref(member) for member in members]
        self.covered = {id(m) for m in top.modules()} if whole_subtree else {id(top)}
        self.local = threading.local()  # per thread: the parameter lists begun, innermost last
        _HintGroup._all.add(self)

    def __deepcopy__(self, memo):
        """A copy of the model (an EMA, torch.optim.swa_utils.AveragedModel) copies its
        hooks, and this with them: the copy is not offload()'s, so its group hints nothing
        (copied whole, its thread-local state could not be copied at all)."""
        inert = object.__new__(_HintGroup)
        inert.top = lambda: None
        inert.members = []
        inert.covered = set()
        inert.local = threading.local()
        return inert

    def open(self) -> list:
        found = getattr(self.local, "open", None)
        if found is None:
            found = self.local.open = []
        return found

    def parameters(self) -> list:
        return [p for ref in self.members if (member := ref()) is not None
                for p in _managed(member)]

    def before(self, _module, _inputs) -> None:
        own = self.parameters()
        self.open().append(own)
        if not own:  # nothing of its own left (a copy's group, or its modules are gone)
            return
        if _overlapping:
            _module_hint(own, True)
        _begin(own)

    def after(self, _module, _inputs, output) -> None:  # always called, also on an error
        begun = self.open()
        if not begun:
            return  # its pre-hook never ran (an earlier pre-hook raised)
        own = begun.pop()
        if not own:
            return
        _end(own)
        if output is not None:
            _hint_backward(own, output)

    def member_before(self, module, inputs) -> None:
        if _writing_back:
            _finish_write_backs()
        if not self.open():  # called on its own, outside `top`'s forward (in this thread)
            _before_forward(module, inputs)

    def member_after(self, module, inputs, output) -> None:
        if not self.open():
            _after_forward(module, inputs, output)

    @staticmethod
    def reset_all() -> None:
        """Closes what forwards that raised left open (PyTorch before 2.1 does not call a
        forward hook then); the uses themselves the engine closes at the step boundary."""
        for group in list(_HintGroup._all):
            group.local = threading.local()


def _managed_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters()
               if getattr(p, "_zeroalloc_adopted", False))


def _new_group(module, group_bytes: int):
    """The group `module` heads when no enclosing group covers it: its whole subtree when
    that holds at most `group_bytes` of managed parameters (or it has no children), else its
    own parameters alone; None when that is nothing."""
    total = _managed_bytes(module)
    if total == 0:
        return None
    if total <= group_bytes or not any(True for _ in module.children()):
        return _HintGroup(module, [m for m in module.modules() if _managed(m)], True)
    return _HintGroup(module, [module], False) if _managed(module) else None


def _group_of(module, group_bytes: int):
    """_new_group, decided once per module and adoption."""
    cached = _groups_headed.get(module)
    if cached is not None and cached[0] == _adoptions[0]:
        return cached[1]
    group = _new_group(module, group_bytes)
    _groups_headed[module] = (_adoptions[0], group)
    return group


#: module -> (adoption count, the group it heads): kept off the module, which may be pickled;
#: the groups hold their modules weakly, so a dropped model is freed.
_groups_headed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _AutomaticHints:
    """The automatic mode's global module hooks, with the grouping of Note [Hint groups]: a
    module the running group covers does nothing (one set lookup); any other module hints
    the group it heads. Parents run their pre-hooks before their children, so the largest
    subtree within the size is found from the top."""

    def __init__(self, group_bytes: int):
        self.group_bytes = group_bytes
        self.local = threading.local()  # the groups whose forward runs, innermost last
        _guard_backward()

    def stack(self) -> list:
        found = getattr(self.local, "stack", None)
        if found is None:
            found = self.local.stack = []
        return found

    def before(self, module, inputs) -> None:
        if _writing_back:
            _finish_write_backs()
        stack = self.stack()
        if stack and id(module) in stack[-1].covered and module is not stack[-1].top():
            return
        group = _group_of(module, self.group_bytes)
        if group is not None:
            stack.append(group)
            group.before(module, inputs)

    def after(self, module, inputs, output) -> None:  # always called, also on an error
        stack = self.stack()
        if stack and stack[-1].top() is module:
            stack.pop().after(module, inputs, output)

    def reset(self) -> None:
        self.local = threading.local()


_automatic: list = []  # the automatic mode's hooks, once enabled


def _always_called(register, hook):
    """Registers a forward hook that runs also when the forward raises (PyTorch 2.1 on;
    before, what a raising forward left open is closed at the step's end)."""
    try:
        return register(hook, always_call=True)
    except TypeError:
        return register(hook)


def _hint_groups(model, group_bytes: int) -> list:
    """Note [Hint groups]: one hint per module costs about 50 us of the training thread (the
    hook calls, the library calls, the output's gradient hook), and a Llama layer has nine
    modules with parameters: the forward, bound by that thread, went from 0.041 to 0.060 s at
    1.3B. So the hints go to the largest subtrees holding at most `group_bytes` of managed
    parameters (a decoder layer), all of a subtree's parameters in one call, and to single
    modules above that. The engine learns and fetches at that granularity, the memory a use
    pins is a subtree's. A member called on its own, outside its group's forward, still
    hints its own parameters (its hooks stand down only while the group's forward runs, in
    that thread): every use of a hinted parameter stays hinted. A module reachable from two
    parents is grouped once."""
    groups, seen = [], set()

    def visit(module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        group = _new_group(module, group_bytes)
        if group is not None:
            groups.append(group)
        if group is None or group.covered == {id(module)}:
            for child in module.children():
                visit(child)
        else:
            seen.update(group.covered)

    visit(model)
    return groups


def _install_hint_hooks(model, group_bytes: int) -> list:
    """The module hooks of offload(): each group's top hints the group; its members hint
    themselves when called outside the group's forward. Returns the hook handles."""
    _guard_backward()
    hooks = []
    for group in _hint_groups(model, group_bytes):
        top = group.top()
        hooks.append(top.register_forward_pre_hook(group.before))
        hooks.append(_always_called(top.register_forward_hook, group.after))
        for member in (ref() for ref in group.members):
            if member is not top:
                hooks.append(member.register_forward_pre_hook(group.member_before))
                hooks.append(_always_called(member.register_forward_hook, group.member_after))
    return hooks


def offload(model: "torch.nn.Module", optimizer: "torch.optim.Optimizer | None" = None, *,
            window_bytes: int = 1 << 30, hint_group_bytes: int = 256 << 20,
            overlap_bytes: int = 2 << 30, gradient_class: "bool | None" = None) -> OffloadHandle:
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
    none). With `gradient_class`, each parameter's gradient is copied into the gradient
    class once a step, where pressure can move it as a last resort (Note [Gradients'
    class]); without, gradients stay with the activations and never move. Not given, it is
    ZEROALLOC_OFFLOAD_GRADIENTS (default 0): off, since gradients in their own class no
    longer reuse the memory the backward frees (bench/RESULTS.md: 1.4 x the step at 1.3B
    where the states alone make room), but on lets a run train under a lower limit.
    Needs ZEROALLOC_OFFLOAD=host in the environment before the library loads."""
    _require_offload_engine()
    if gradient_class is None:
        gradient_class = gradient_class_default()
    hooked: list = []
    hooks = _adopt(model.parameters(), optimizer, gradient_class, hooked)
    stepper = getattr(optimizer, "_zeroalloc_stepper", None)
    if not _automatic and stepper is None:
        # Else hinted already: by the automatic mode's global hooks, or by the hooks of the
        # earlier offload() of this optimizer.
        hooks += _install_hint_hooks(model, hint_group_bytes)

    def adopt(late, into):
        if not _automatic:
            # Only parameters offload() moved (frozen then, unfrozen since): one outside the
            # model (a group added later) has no hint group, and unhinted use must not
            # share the hinted parameter class, so it stays where it is, unmanaged.
            late = [p for p in late if getattr(p, "_zeroalloc_adopted", False)]
        return _adopt(late, None, gradient_class, into) if late else []

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

        return OffloadHandle(hooks, None, None, hooked, restore=restore)
    put_back = None  # what remove() puts back as optimizer.step
    if optimizer is not None:
        put_back = _original_of(optimizer, "step")
        optimizer.step = _windowed_step(optimizer, optimizer.step, window_bytes, overlap_bytes,
                                        adopt=adopt)
        _readopt_after_load(optimizer)
    return OffloadHandle(hooks, optimizer, put_back, hooked)


def enable_automatic_offload(window_bytes: int = 1 << 30, hint_group_bytes: int = 256 << 20,
                             overlap_bytes: int = 2 << 30,
                             gradient_class: "bool | None" = None) -> None:
    """Offload with no line changed in the training script (ZEROALLOC_OFFLOAD=host with the
    package's start-up hook): every optimizer created from now on has its parameters and
    states managed as offload() does, and global module hooks send the use hints, grouped
    as offload() groups them (Note [Hint groups])."""
    _require_offload_engine()
    if gradient_class is None:
        gradient_class = gradient_class_default()
    hints = _AutomaticHints(hint_group_bytes)
    _automatic.append(hints)
    torch.nn.modules.module.register_module_forward_pre_hook(hints.before)
    _always_called(torch.nn.modules.module.register_module_forward_hook, hints.after)
    original_init = torch.optim.Optimizer.__init__

    def init(self, params, defaults, *args, **kwargs):
        original_init(self, params, defaults, *args, **kwargs)
        if getattr(self, "_zeroalloc_adopted", False):
            return
        self._zeroalloc_adopted = True
        parameters = [p for group in self.param_groups for p in group["params"]]
        _adopt(parameters, self, gradient_class)
        self.step = _windowed_step(self, self.step, window_bytes, overlap_bytes,
                                   adopt=lambda late, into: _adopt(late, None, gradient_class,
                                                                   into))
        _readopt_after_load(self)

    torch.optim.Optimizer.__init__ = init


def _remove(entries: list, entry) -> None:
    """Removes `entry` by identity (== on entries would compare tensors)."""
    for index, each in enumerate(entries):
        if each is entry:
            del entries[index]
            return


def _steps_by_param_groups(optimizer) -> bool:
    """Whether the optimizer's step steps exactly the parameters of its param_groups (Note
    [Steps that follow param_groups]): the class that defines its step is one of torch.optim's
    own, and not LBFGS."""
    if isinstance(optimizer, torch.optim.LBFGS):
        return False
    for cls in type(optimizer).__mro__:
        if "step" in vars(cls):
            # The function, not the class: Optimizer.__init__ may have written a profiling
            # wrapper of an inherited step onto a plain subclass (functools.wraps keeps the
            # wrapped function's module).
            return getattr(vars(cls)["step"], "__module__", "").startswith("torch.optim.")
    return False


def _windowed_step(optimizer, original_step, window_bytes: int, overlap_bytes: int = 0,
                   adopt=None):
    """optimizer.step in windows of about `window_bytes` of parameters and states, as a bound
    method (LR schedulers wrap it through __func__ and __self__); `overlap_bytes` of states
    are moved while forward and backward run (Note [Overlapping the step]).

    Note [Stepping states where they are]: optimizer states are touched once per step, in one
    pass, so they are not fetched (a remap of host memory costs more than the transfer): each
    window's states are pinned where they are (use_in_place); those on the host are copied
    into device scratch on one stream while the previous window steps, stepped there by the
    optimizer's own kernels, and copied back on another stream. Copies in and out overlap
    each other and the kernels; the results are bit for bit those of a step on the device
    (bench/python/optimizer_step_bench.py compares this with stepping over PCIe, with
    fetching and evicting, and with a CPU Adam). States that are not contiguous are reached
    where they are. The step's temporaries (foreach intermediates) are allocated with the
    activations; states the step creates move into the optimizer-state class after their
    window. Every hint opened is closed, and the copies are waited for in the step's
    stream, also when a window fails.
    Note [Windows and buffers]: copies in and out run at once, each at the PCIe rate, while
    the kernels take a fraction of that. A window's copy out follows its copy in and its
    step, so the step costs the bytes bounced one way plus about one window (the out stream
    waits for the first, the in stream has nothing left during the last). Smaller windows
    shorten that and add per-window costs (Python, launches): from 128 MiB to 1 GiB the step
    measured the same (bench/RESULTS.md). Ramping the sizes at the ends does not help: the
    out stream then waits for the first large window instead. Window n uses scratch buffer
    n mod B, B at least three: with two, a window's copy in would wait for the write-back
    of the window just before it, which waits for that window's step, adding half a
    window's kernels to every window; with three it waits for one long done. Copies in are
    queued up to B - 1 windows ahead.
    Note [Overlapping the step]: even so the step costs the host-resident states' bytes
    over PCIe one way, while the link idles during forward and backward. So the first
    windows' states are staged into scratch during the backward before a step (their
    values are final since the last step), and the last windows' states stay in scratch
    after the step, in the state dict (so a reader sees their values; state_dict() puts
    the states' own tensors back first), and are written back during the next forward;
    each at most `overlap_bytes` of device memory (a window's buffer counts whole).
    Staging begins once 60% of the last backward's accumulations into the optimizer's
    parameters are done (learned from the step before, so with gradient accumulation it
    happens in the last backward only), one window per accumulation, while the device has
    room under its limit for it plus a margin (the backward frees activations as it goes);
    windows with nothing on the host are left to the step. It needs the same windows as
    the last step with the same, unwritten state tensors, else what was staged is
    dropped, as it is when a forward of the model comes before the step. States are kept only
    when module hints ran between the last two steps (a training loop: the next forward's
    first hint writes them back, and the forward of any hinted module after that puts the
    state tensors back and frees the scratch once the copies are done: a model hinted as
    one group would otherwise hold it until its backward, at its forward's peak); the next
    step, load_state_dict and OffloadHandle.remove() write them
    back first. Staged and kept states stay pinned (use_in_place) until their copies end,
    also across the step boundary.
    Known limits: the optimizer's step hooks (register_step_pre_hook / post_hook) run once
    per window, with the window's parameters in param_groups; an optimizer whose parameters
    span several devices steps in one piece, without windows. Between a step and the next
    forward, the last windows' state tensors are device scratch: writing into them before
    the next forward is kept, replacing them is honoured; their storage is not the
    optimizer-state class's (offload_tensor, fetch_tensor and residency act on the states'
    own tensors). A state written in place between the backward that staged it and the
    step is staged again (its version counter changed); a write the counter does not see
    (through .data, DLPack or a kernel of one's own) is overwritten by the staged copy. Not
    thread-safe: one thread's forwards and steps per optimizer (DataParallel replicas would
    race)."""
    if getattr(original_step, "_zeroalloc_windowed", False):
        return original_step  # offload() and the automatic mode never wrap twice
    stepper = _WindowedStep(optimizer, original_step, window_bytes, overlap_bytes, adopt)
    optimizer._zeroalloc_stepper = stepper

    def step(self, closure=None, **kwargs):
        return stepper.step(closure, **kwargs)

    step._zeroalloc_windowed = True
    if getattr(original_step, "_wrapped_by_lr_sched", False):
        # An LR scheduler made before offload() wrapped the step to see it called; its
        # wrapper still runs (each window calls it), so say so, or the scheduler warns that
        # the step was overridden after it.
        step._wrapped_by_lr_sched = True
    return _BoundWeakly(step, optimizer)  # Note [No cycles through the optimizer]


#: Windowed steps that move states between steps (Note [Overlapping the step]): module hints
#: and gradient accumulations reach them. Weak: a dropped optimizer takes its step along.
_overlapping: "weakref.WeakSet" = weakref.WeakSet()
#: Windowed steps whose kept states are being written back: every hinted module's forward
#: asks whether the copies are done, to free the scratch early (Note [Overlapping the step]).
_writing_back: "weakref.WeakSet" = weakref.WeakSet()
_STAGE_AFTER = 0.6  # of the last backward's accumulations
_STAGE_RETRY = 4  # accumulations to wait after finding no room


def _finish_write_backs() -> None:
    """Puts back the state tensors of kept states whose write-back is done, freeing their
    scratch."""
    for stepper in tuple(_writing_back):
        stepper.write_back_kept(wait=False)


def _module_hint(own: list, forward: bool) -> None:
    """A forward or backward module hint for the parameters `own`: windowed steps learn that
    a training loop runs, and write back what the last step kept on the device; a forward of
    their own model outside any backward (not a checkpointed layer's recomputation) drops
    what was staged for a step that did not come."""
    for stepper in tuple(_overlapping):
        stepper.module_hint(own, forward)


def _on_gpu(device) -> bool:
    """Whether parameters on `device` step in windows (they have CUDA streams)."""
    return device.type == "cuda"


def _is_paged_state(value) -> bool:
    """A state the windowed step pins and may bounce: a non-empty tensor on a GPU (the step
    count of foreach optimizers is a scalar on the CPU)."""
    return torch.is_tensor(value) and value.is_cuda and value.dim() > 0 and value.numel() > 0


def _padded(nbytes: int) -> int:
    return -(-nbytes // 512) * 512


def _scratch_size(tensor) -> int:
    """A state's bytes in a scratch buffer (each starts 512-byte aligned)."""
    return _padded(tensor.numel() * tensor.element_size())


def _copied_bytes(entries) -> int:
    """Scratch taken by the entries whose state is copied through it."""
    return sum(_scratch_size(entry[2]) for entry in entries if entry[3] is not None)


def _where(tensor) -> str:
    """The tensor's residency; "foreign" for memory the engine does not manage."""
    try:
        return _offload.residency_of(tensor.untyped_storage().data_ptr())
    except ZeroallocError:
        return "foreign"


def _bounced(tensor, places) -> bool:
    """Whether a state is copied through scratch: off the device, and laid out so that a
    contiguous copy has the same strides (else the kernels reach it where it is)."""
    return tensor.is_contiguous() and places[id(tensor)] not in ("device", "foreign")


class _WindowedStep:
    """The windowed step of one optimizer and what it holds between steps. An entry is
    [state dict, key, home tensor, scratch view or None, pinned, parameter, the home's
    version counter when it was staged]."""

    def __init__(self, optimizer, original_step, window_bytes: int, overlap_bytes: int,
                 adopt=None):
        # Weakly, and the original step unbound (Note [No cycles through the optimizer]):
        # the optimizer holds this, through its step.
        self._optimizer = weakref.ref(optimizer)
        # Parameters that need hooks after offload() (a parameter unfrozen since; in the
        # automatic mode, whose hints cover every module, also a group added with
        # add_param_group) get them at the next step: adopt(parameters, hooked) -> hooks,
        # appending (parameter, mark) for each hook to `hooked`.
        self.adopt = adopt
        self.late_hooks: list = []
        self.late_hooked: list = []  # (weak reference, mark), as OffloadHandle's
        self._original_step = _unbound(original_step, optimizer)
        self.window_bytes = window_bytes
        self.overlap_bytes = overlap_bytes
        # Note [Steps that follow param_groups]: a window is stepped by narrowing param_groups
        # and calling the optimizer's own step, which is right only for a step that steps
        # exactly the parameters of param_groups, once: PyTorch's own optimizers (LBFGS
        # excepted: it steps a list of its own, and needs its closure). Any other (a
        # ZeroRedundancyOptimizer steps its whole shard through an inner optimizer; a
        # subclass may override step) steps in one piece, each parameter once.
        self.by_groups = _steps_by_param_groups(optimizer)
        if not self.by_groups:
            warnings.warn(f"zeroalloc: {type(optimizer).__name__}.step does not step the "
                          "parameters of param_groups as torch.optim's optimizers do, so it "
                          "runs in one piece, not in windows: host-resident states are reached "
                          "where they are (slower)")
        self.streams: dict = {}  # device index -> (copy in, copy out)
        self.warned = False
        self.cache = None  # parameter id -> its states, during a step
        # Scratch: window n uses slot n mod len(slots); free[slot]: its last write-back.
        self.slots: list = []
        self.free: list = []
        self.slot_bytes = 0
        self.retired: list = []  # buffers replaced by larger ones, freed after the step
        # Learned from the last step (Note [Overlapping the step]).
        self.plan: list = []  # its windows
        self.plan_bytes = 0  # the scratch of its largest window
        self.per_step = 0  # gradient accumulations between the last two steps
        self.last_backward = 0  # of those, in the backward just before the step
        self.accumulations = 0  # since the last step
        self.in_backward = 0  # in the running backward
        self.task = None
        # Ids of the parameters it steps: only their accumulations count.
        self.members = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.hinted = False  # a module hint since the last step
        # Held between steps.
        self.staged: list = []  # (entries, copies done event or None) of windows 0, 1, ...
        self.staged_bytes = 0
        self.staging_stream = None
        self.staging_device = None
        self.limit_bytes = 0
        self.staging_done = False
        self.next_attempt = 0
        self.next_window = None  # (number, residencies, scratch bytes) of the next to stage
        self.kept: list = []  # entries whose states stay in scratch after the step
        self.written = None  # event: the kept states' write-back is done
        self.figures = {"steps": 0, "staged_windows": 0, "staged_bytes": 0, "kept_windows": 0,
                        "kept_bytes": 0, "written_back_during_forward": 0,
                        "staging_host_s": 0.0, "staging_no_room": 0, "staging_began_at": 0.0}
        if overlap_bytes > 0:
            _overlapping.add(self)

    # -- helpers ---------------------------------------------------------------------------
    @property
    def optimizer(self):
        return self._optimizer()

    def original_step(self, *args, **kwargs):
        return self._original_step(self.optimizer, *args, **kwargs)

    def items(self, parameter) -> list:
        if self.cache is not None:
            found = self.cache.get(id(parameter))
            if found is not None:
                return found
        found = [(key, value) for key, value in self.optimizer.state.get(parameter, {}).items()
                 if _is_paged_state(value)]
        if self.cache is not None:
            self.cache[id(parameter)] = found
        return found

    def forget(self, parameters) -> None:
        for parameter in parameters:
            self.cache.pop(id(parameter), None)

    def budget(self) -> int:
        """Bytes of states moved between steps: overlap_bytes, at most an eighth of the
        device's limit (read at the last step)."""
        return min(self.overlap_bytes, self.limit_bytes // 8)

    def windows(self, groups) -> list:
        """Windows over the parameters with gradients, from the groups as they were before
        any window narrowed them."""
        found, current, size = [], [], 0
        for params in groups:
            for parameter in params:
                if parameter.grad is None:
                    continue
                cost = parameter.numel() * parameter.element_size() * 3  # + two Adam states
                if current and size + cost > self.window_bytes:
                    found.append(current)
                    current, size = [], 0
                current.append(parameter)
                size += cost
        if current:
            found.append(current)
        return found

    def scratch_bytes(self, window, places) -> int:
        """Room for the window's bounced states: those on the device need none, and the
        buffers come out of the memory the activations just left (larger ones would make
        that class grow, and push more states to the host)."""
        return sum(_scratch_size(value) for parameter in window
                   for _, value in self.items(parameter) if _bounced(value, places))

    def streams_of(self, device):
        if device.index not in self.streams:
            self.streams[device.index] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self.streams[device.index]

    def stage(self, window, slot: int, places, copy_in, main, held: list):
        """Pins the window's states where they are (their entries go into `held` first: a
        failure still ends them) and starts copying the bounced ones into scratch slot
        `slot`, after that slot's last write-back; returns (entries, event after the
        copies, or None when nothing is copied)."""
        entries = []
        for parameter in window:
            state = self.optimizer.state.get(parameter, {})
            for key, home in self.items(parameter):
                entries.append([state, key, home, None, places[id(home)] != "foreign",
                                parameter, home._version])
        pinned = [entry for entry in entries if entry[4]]
        held.extend(entries)
        if pinned:
            _offload.use_in_place_many(_pointers(entry[2] for entry in pinned),
                                       copy_in.cuda_stream)
        bounced = [entry for entry in pinned if _bounced(entry[2], places)]
        if not bounced:
            return entries, None
        need = sum(_scratch_size(entry[2]) for entry in bounced)
        while len(self.slots) <= slot:
            self.slots.append(None)
            self.free.append(None)
        buffer = self.slots[slot]
        if buffer is None or buffer.numel() < need:
            if buffer is not None:
                self.retired.append(buffer)
            with allocation_class("other"):
                buffer = torch.empty(max(need, self.slot_bytes), dtype=torch.uint8,
                                     device=window[0].device)
            self.slots[slot] = buffer
            copy_in.wait_stream(main)  # the memory may be what main's last kernels used
        offset = 0
        for entry in bounced:
            home = entry[2]
            nbytes = home.numel() * home.element_size()
            entry[3] = buffer[offset:offset + nbytes].view(home.dtype).view(home.shape)
            offset += _padded(nbytes)
        if self.free[slot] is not None:
            copy_in.wait_event(self.free[slot])  # the slot's last step and write-back
        with torch.cuda.stream(copy_in):
            for entry in bounced:
                entry[3].copy_(entry[2], non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_in)
        return entries, done

    # -- between steps (Note [Overlapping the step]) ---------------------------------------
    def module_hint(self, own: list, forward: bool) -> None:
        self.hinted = True
        if self.kept:
            self.write_back_kept(wait=False)
        if (forward and self.staged and _graph_task() is None
                and any(id(p) in self.members for p in own)):
            self.drop_staged()  # staged for a step that did not come: unpin, free
            self.staging_done = True

    def accumulated(self, task) -> None:
        """A gradient accumulation into a managed parameter: may stage the next step's first
        windows. A failure stops staging until the next step and never reaches the
        backward."""
        if task != self.task:
            self.task, self.in_backward = task, 0
        self.in_backward += 1
        self.accumulations += 1
        if (self.staging_done or not self.plan or not self.per_step
                or self.accumulations < self.next_attempt):
            return
        if self.accumulations < self.per_step - (1 - _STAGE_AFTER) * self.last_backward:
            return
        started = time.perf_counter()
        try:
            self.stage_next()
        except Exception as error:  # noqa: BLE001 (the step does without)
            self.staging_done = True
            try:
                self.drop_staged()
            except Exception:  # noqa: BLE001
                pass
            if not self.warned:
                self.warned = True
                warnings.warn(f"zeroalloc: staging optimizer states during backward failed "
                              f"({error}); the step copies them itself")
        finally:
            self.figures["staging_host_s"] += time.perf_counter() - started

    def stage_next(self) -> None:
        number = len(self.staged)
        if number >= len(self.plan):
            self.staging_done = True
            return
        window = self.plan[number]
        device = window[0].device
        main = torch.cuda.current_stream(device)
        copy_in, copy_out = self.streams_of(device)
        if self.staging_stream is None:
            self.write_back_kept(wait=True)  # done long ago: the homes hold the values
            self.staging_stream = main
            self.staging_device = device
            self.slot_bytes = self.plan_bytes
            copy_in.wait_stream(main)
            copy_in.wait_stream(copy_out)  # the last step's write-backs
        elif self.staging_stream != main:
            self.staging_done = True
            return
        if self.next_window is None or self.next_window[0] != number:
            # Asked once per window (a library call per state), not on every attempt.
            places = {id(value): _where(value) for parameter in window
                      for _, value in self.items(parameter)}
            self.next_window = (number, places, self.scratch_bytes(window, places))
        _, places, need = self.next_window
        if not need:  # nothing to copy: the step pins it, no earlier
            self.staged.append(None)
            self.next_window = None
            return
        size = max(need, self.slot_bytes)  # the slot's buffer, what the device holds
        if self.staged_bytes + size > self.budget():
            self.staging_done = True
            return
        # A cached block the backward freed, or room under the limit with a margin left for
        # the rest of the backward (the first steps may release cache for it; the block
        # stays cached for later ones).
        largest, unallocated = room(device.index, "other")
        margin = max(1 << 30, self.limit_bytes // 16)
        if largest < size and unallocated < size + margin:
            self.next_attempt = self.accumulations + _STAGE_RETRY
            self.figures["staging_no_room"] += 1
            return
        if not any(self.staged):
            self.figures["staging_began_at"] = self.accumulations / max(1, self.per_step)
        held: list = []
        try:
            self.staged.append(self.stage(window, number, places, copy_in, main, held))
        except BaseException:
            self.end_uses(held, copy_in)
            raise
        self.staged_bytes += size
        self.next_window = None
        self.figures["staged_windows"] += 1
        self.figures["staged_bytes"] += need

    def end_uses(self, entries, stream) -> None:
        pinned = [entry for entry in entries if entry[4]]
        if pinned:
            _offload.use_ends_many(_pointers(entry[2] for entry in pinned), stream.cuda_stream)

    def drop_staged(self) -> None:
        """Ends what was staged and frees its scratch after its copies."""
        staged, self.staged, self.staged_bytes = self.staged, [], 0
        self.staging_stream = None
        if self.staging_device is None:
            return
        copy_in = self.streams_of(self.staging_device)[0]
        for each in staged:
            if each is not None:
                self.end_uses(each[0], copy_in)
        for buffer in self.slots:
            if buffer is not None:
                buffer.record_stream(copy_in)
        self.slots, self.free = [], []
        self.staging_device = None

    def take_staged(self, found, main) -> list:
        """What the backward staged, when it is what this step would stage (else dropped)."""
        if not any(self.staged):
            self.drop_staged()  # also a slot a failed staging left
            return []
        valid = self.staging_stream == main and len(found) >= len(self.staged)
        for number, each in enumerate(self.staged):
            if not valid:
                break
            if each is None:
                continue
            entries = each[0]
            window, planned = found[number], self.plan[number]
            # Same parameters, same state tensors, none written since it was staged.
            valid = (len(window) == len(planned)
                     and all(a is b for a, b in zip(window, planned))
                     and len(entries) == sum(len(self.items(p)) for p in window)
                     and all(self.optimizer.state.get(entry[5]) is entry[0]
                             and entry[0].get(entry[1]) is entry[2]
                             and entry[2]._version == entry[6] for entry in entries))
        if not valid:
            self.drop_staged()
            return []
        staged, self.staged, self.staged_bytes = self.staged, [], 0
        self.staging_stream = None
        self.staging_device = None
        return staged

    def write_back_kept(self, wait: bool) -> None:
        """Writes back the states the last step kept in scratch (copy out, after the current
        stream) and, once that is done, puts the states' own tensors back in the state
        dicts. `wait`: the current stream waits for it, so they are back now."""
        if not self.kept:
            return
        device = self.kept[0][2].device
        main = torch.cuda.current_stream(device)
        if self.written is None:
            copy_out = self.streams_of(device)[1]
            copy_out.wait_stream(main)
            with torch.cuda.stream(copy_out):
                for entry in self.kept:
                    state, key, home, parameter = entry[0], entry[1], entry[2], entry[5]
                    current = state.get(key)
                    entry[3] = current
                    if (self.optimizer.state.get(parameter) is not state
                            or not torch.is_tensor(current) or current.shape != home.shape
                            or current.device != home.device or current.dtype != home.dtype):
                        entry[3] = None  # replaced (load_state_dict): nothing to write back
                        continue
                    if current is not home:
                        home.copy_(current, non_blocking=True)
                        current.record_stream(copy_out)  # freed in another stream's order
                self.end_uses(self.kept, copy_out)
            self.written = torch.cuda.Event()
            self.written.record(copy_out)
            _writing_back.add(self)
            for entry in self.kept:  # the stream's own memory from here: no more pins
                entry[4] = False
        if wait:
            main.wait_event(self.written)
        elif not self.written.query():
            return
        else:
            self.figures["written_back_during_forward"] += 1
        for entry in self.kept:
            state, key, home, copied = entry[0], entry[1], entry[2], entry[3]
            if copied is not None and state.get(key) is copied:
                state[key] = home
        for registered in [key for key, owner in _kept_states.items() if owner is self]:
            del _kept_states[registered]
        _writing_back.discard(self)
        self.kept, self.written = [], None

    def repin(self) -> None:
        """After a step boundary (which closes every use): pins again what this step holds."""
        held = [entry for entry in self.kept if entry[4]]
        held += [entry for each in self.staged if each is not None for entry in each[0]
                 if entry[4]]
        if held:
            _hint(_offload.use_in_place_many, [entry[2] for entry in held], 0)

    def settle(self) -> None:
        """Writes back what was kept and drops what was staged (load_state_dict, remove())."""
        self.write_back_kept(wait=True)
        self.drop_staged()

    def configure(self, window_bytes: int, overlap_bytes: int, adopt) -> None:
        """New sizes (a later offload() of the same optimizer), from the next step on: what
        was kept or staged goes home, and the windows are learned again."""
        self.settle()
        self.window_bytes, self.overlap_bytes, self.adopt = window_bytes, overlap_bytes, adopt
        self.plan, self.plan_bytes = [], 0
        if overlap_bytes > 0:
            _overlapping.add(self)
        else:
            _overlapping.discard(self)

    # -- the step --------------------------------------------------------------------------
    def adopt_new_states(self, fresh) -> None:
        """States the optimizer created in this window (in the step's class, "other") move
        into the optimizer-state class, where the engine may page them."""
        for parameter in fresh:
            state = self.optimizer.state.get(parameter, {})
            for key, value in self.items(parameter):
                state[key] = _move_into_class(value, "optimizer_state")

    def step_in_one_piece(self, groups, closure, kwargs):
        """The optimizer's own step over every parameter at once, its paged states pinned
        where they are for it (hint every use of a class, or none), and the states it
        creates moved into the optimizer-state class afterwards, as a window's are."""
        parameters = [p for params in groups for p in params]
        states = [value for p in parameters for _, value in self.items(p)]
        fresh = [p for p in parameters if not self.items(p)]
        try:
            if states:  # inside: a pin that fails half-way is still ended (surplus ends
                _hint(_offload.use_in_place_many, states, 0)  # are ignored)
            with allocation_class("other"):
                if closure is not None and not self.by_groups:
                    loss = self.original_step(closure, **kwargs)
                else:
                    loss = self.original_step(**kwargs)
        finally:
            if states:
                _hint(_offload.use_ends_many, states, 0)
        self.forget(fresh)  # the step may have created their states
        self.adopt_new_states(fresh)
        self.forget(fresh)
        return loss

    def keep_from(self, found, staged, places) -> int:
        """The first of the last windows whose bounced states stay in scratch after the step
        (len(found): none)."""
        first, total = len(found), 0
        if self.overlap_bytes <= 0:
            return first
        self.limit_bytes = raw_stats(found[0][0].device.index)["limit_bytes"]
        if not self.hinted:
            return first
        budget = self.budget()
        while first > 0 and len(found) - first < max(3, len(staged) + 2):
            number = first - 1
            if number < len(staged) and staged[number] is not None:
                bounced = any(e[3] is not None for e in staged[number][0])
            else:
                bounced = self.scratch_bytes(found[number], places) > 0
            cost = self.slot_bytes if bounced else 0  # a kept window holds its slot's buffer
            if total + cost > budget:
                break
            total += cost
            first = number
        return first

    def step(self, closure=None, **kwargs):
        optimizer = self.optimizer
        loss = None
        if self.adopt is not None:
            late = [p for group in optimizer.param_groups for p in group["params"]
                    if p.requires_grad and not getattr(p, "_zeroalloc_hooked", False)]
            if late:
                hooked: list = []
                self.late_hooks += self.adopt(late, hooked)
                self.late_hooked += [(weakref.ref(parameter), mark) for parameter, mark in hooked]
        if closure is not None and self.by_groups:  # evaluated once, then the windows step
            with torch.enable_grad():
                loss = closure()
        self.cache = {}
        saved = [group["params"] for group in optimizer.param_groups]
        held: list = []  # entries pinned and not yet ended
        swapped: list = []  # entries whose scratch is in the state dict now
        kept: list = []  # entries of the last windows, kept in scratch (succeeded only)
        begun = None  # the window whose parameters' use is open
        copies = None
        succeeded = False
        found: list = []
        try:
            self.write_back_kept(wait=True)
            found = self.windows(saved) if self.by_groups else []
            devices = {p.device for window in found for p in window}
            if len(devices) > 1 and not self.warned:
                self.warned = True
                warnings.warn("zeroalloc: the optimizer's parameters span several devices "
                              f"({sorted(str(d) for d in devices)}); its step runs in one "
                              "piece, reaching host-resident states where they are (slower)")
            # Parameters in host memory (CPU master weights, a small side model): nothing
            # there is paged, and CUDA streams do not exist for them.
            if not found or len(devices) > 1 or not _on_gpu(next(iter(devices))):
                found = []  # nothing to stage for the next step either
                self.drop_staged()
                result = self.step_in_one_piece(saved, closure, kwargs)
                loss = result if result is not None else loss
            else:
                device = found[0][0].device
                copies = self.streams_of(device)
                copy_in, copy_out = copies
                main = torch.cuda.current_stream(device)
                # Windows the backward staged (None: one with nothing to copy, left to now).
                staged = self.take_staged(found, main)
                for each in staged:
                    if each is not None:
                        held.extend(each[0])
                # Each state's residency, asked once (a call into the library each). A state
                # the engine moves before its window is pinned is still stepped correctly:
                # in place if it left the device, through a redundant copy if it came back.
                unstaged = [window for number, window in enumerate(found)
                            if number >= len(staged) or staged[number] is None]
                places = {id(value): _where(value) for window in unstaged
                          for parameter in window for _, value in self.items(parameter)}
                sizes = [_copied_bytes(each[0]) for each in staged if each is not None]
                sizes += [self.scratch_bytes(window, places) for window in unstaged]
                self.slot_bytes = max(sizes)
                keep_from = self.keep_from(found, staged, places)
                count = min(len(found), max(3, len(staged) + 2, len(found) - keep_from))
                while len(self.slots) < count:
                    self.slots.append(None)
                    self.free.append(None)
                copy_in.wait_stream(main)  # the scratch is allocated in main's order
                copy_in.wait_stream(copy_out)  # and the last step's write-backs
                # Per window: its entries and copies' event, staged up to count ahead.
                queued = [None] * len(found)
                ready = [None] * len(found)
                for number, each in enumerate(staged):
                    if each is not None:
                        queued[number], ready[number] = each
                cursor = 0  # the next window that may need staging
                for number, window in enumerate(found):
                    while cursor < len(found) and cursor < number + count:
                        if queued[cursor] is None:
                            queued[cursor], ready[cursor] = self.stage(
                                found[cursor], cursor % count, places, copy_in, main, held)
                        cursor += 1
                    entries = queued[number]
                    if ready[number] is not None:
                        main.wait_event(ready[number])
                    for entry in entries:
                        if entry[3] is not None:
                            entry[0][entry[1]] = entry[3]
                            swapped.append(entry)
                    chosen = {id(p) for p in window}
                    fresh = [p for p in window if not self.items(p)]
                    _begin(window, main.cuda_stream)
                    begun = window
                    for group, params in zip(optimizer.param_groups, saved):
                        group["params"] = [p for p in params if id(p) in chosen]
                    # Temporaries of the step (foreach intermediates) go with activations.
                    with allocation_class("other"):
                        self.original_step(**kwargs)
                    _end(window, main.cuda_stream)
                    begun = None
                    self.forget(window)  # the optimizer may have created or replaced states
                    keep = number >= keep_from
                    if keep:
                        self.figures["kept_windows"] += 1
                        self.figures["kept_bytes"] += _copied_bytes(entries)
                    ending = [e for e in entries if e[4] and not (keep and e[3] is not None)]
                    copy_out.wait_stream(main)
                    with torch.cuda.stream(copy_out):
                        for entry in entries:
                            state, key, home, scratch = entry[:4]
                            if scratch is None:
                                continue
                            _remove(swapped, entry)
                            if keep:
                                kept.append(entry)
                                continue
                            current = state[key]
                            home.copy_(current, non_blocking=True)
                            if current is not scratch:  # the optimizer replaced it
                                current.record_stream(copy_out)
                            state[key] = home
                        # Every end on copy_out, which follows main: the chunk's fence
                        # covers both the step and the write-back.
                        if ending:
                            _offload.use_ends_many(_pointers(e[2] for e in ending),
                                                   copy_out.cuda_stream)
                        done_ids = {id(e) for e in entries}
                        held[:] = [e for e in held if id(e) not in done_ids]
                        if not keep:
                            slot = number % count
                            self.free[slot] = torch.cuda.Event()
                            self.free[slot].record(copy_out)
                    self.adopt_new_states(fresh)  # after the write-backs: a failure here loses none
                    self.forget(fresh)
            succeeded = True
        finally:
            for entry in swapped:  # a window failed: its states stay as they were
                entry[0][entry[1]] = entry[2]
            for group, params in zip(optimizer.param_groups, saved):
                group["params"] = params
            fence, wait_error = 0, None
            if copies is not None:
                main = torch.cuda.current_stream(copies[0].device)
                fence = main.cuda_stream
                try:
                    main.wait_stream(copies[0])  # the scratch is freed in main's order after
                    main.wait_stream(copies[1])  # every copy; later reads see the write-backs
                except Exception as error:  # a device error; a failed step's own error wins
                    wait_error = error
            self.kept.extend(kept)  # empty, unless writing back the last step's failed
            if not succeeded and kept:
                try:  # stepped: written back now
                    self.write_back_kept(wait=True)
                except Exception as error:  # noqa: BLE001
                    wait_error = wait_error or error
            # Pinned by a window that failed or never ran.
            _offload.use_ends_many(_pointers(entry[2] for entry in held if entry[4]), fence)
            if begun is not None:
                _end(begun, fence)
            self.slots, self.free, self.retired = [], [], []
            self.cache = None
            if wait_error is not None and succeeded:
                raise wait_error
        _offload.step_boundary()
        # The boundary closed every use; a backward that raised never ran the callback that
        # forgets what it began (and holds those parameters).
        _backward_open.clear()
        for stepper in tuple(_overlapping):
            stepper.repin()
        for entry in self.kept:
            _kept_states[id(entry[0].get(entry[1]))] = self
        _HintGroup.reset_all()
        for hints in _automatic:
            hints.reset()
        # Learned for the next step.
        self.figures["steps"] += 1
        self.members = {id(p) for params in saved for p in params}
        self.plan = found
        self.plan_bytes = self.slot_bytes
        self.per_step, self.last_backward = self.accumulations, self.in_backward
        self.accumulations = self.in_backward = 0
        self.task = None
        self.hinted = False
        self.staging_done = False
        self.next_attempt = 0
        self.next_window = None
        return loss


def step_figures(optimizer) -> dict:
    """What the windowed step of `optimizer` (offload()) moved while forward and backward ran,
    over its steps: windows and bytes staged during backward, kept on the device after a
    step, and writes-back finished during a forward (Note [Overlapping the step])."""
    stepper = getattr(optimizer, "_zeroalloc_stepper", None)
    if stepper is None:
        raise ZeroallocError("this optimizer's step is not zeroalloc's windowed step: "
                             "pass it to zeroalloc.torch.offload() first")
    return dict(stepper.figures)


def _readopt_after_load(optimizer) -> None:
    """optimizer.load_state_dict rebuilds the states in the default class: move them back
    into the optimizer-state class, where the engine may page them. Both it and state_dict
    first put back the states the windowed step kept in scratch (Note [Overlapping the
    step])."""
    if getattr(optimizer.load_state_dict, "_zeroalloc_readopts", False):
        return
    # Unbound, and stored weakly bound (Note [No cycles through the optimizer]).
    original_load = optimizer.load_state_dict
    load = _unbound(original_load, optimizer)

    def load_state_dict(self, state_dict):
        stepper = getattr(self, "_zeroalloc_stepper", None)
        if stepper is not None:  # states kept or staged by the last step go home first
            stepper.settle()
        load(self, state_dict)
        _adopt([], self)

    load_state_dict._zeroalloc_readopts = True
    # What OffloadHandle.remove() puts back.
    load_state_dict._zeroalloc_original = _original_of(optimizer, "load_state_dict")
    optimizer.load_state_dict = _BoundWeakly(load_state_dict, optimizer)
    original_state_dict = optimizer.state_dict
    save = _unbound(original_state_dict, optimizer)

    def state_dict(self):
        stepper = getattr(self, "_zeroalloc_stepper", None)
        if stepper is not None:  # kept states: their own tensors, not views of a slot
            stepper.write_back_kept(wait=True)
        return save(self)

    state_dict._zeroalloc_original = _original_of(optimizer, "state_dict")
    optimizer.state_dict = _BoundWeakly(state_dict, optimizer)
