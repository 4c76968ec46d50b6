"""zeroalloc for PyTorch.

``install()`` makes zeroalloc PyTorch's CUDA allocator for the whole process (two lines in a
script); ``mem_pool()`` routes only the allocations made inside ``torch.cuda.use_mem_pool``
through zeroalloc and leaves PyTorch's own allocator, statistics and cudnn for the rest.
"""

from __future__ import annotations

import torch

import contextlib
import threading
import types
import warnings
import weakref
from collections.abc import Mapping
from typing import Iterable

from zeroalloc import _offload
from zeroalloc._library import ZeroallocError, function_address, library_path
from zeroalloc._stats import allocation_class, raw_stats

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


def mem_pool() -> "torch.cuda.MemPool":
    """A torch.cuda.MemPool whose segments come from zeroalloc:
    ``with torch.cuda.use_mem_pool(zt.mem_pool()): ...``"""
    return torch.cuda.MemPool(_pluggable_allocator().allocator())


# ---- Offload ---------------------------------------------------------------------------------

def offload_tensor(tensor: "torch.Tensor", wait: bool = True) -> None:
    """Moves the tensor's storage to pinned host memory; its address, and every view of it,
    stay valid (kernels reach it over PCIe until it comes back). With `wait=False`, queue no
    work on the tensor until `residency(tensor)` stops answering "moving". Memory it shares
    a chunk with, in use by a hinted module or optimizer step, stays on the device."""
    _offload.offload_pointer(tensor.untyped_storage().data_ptr(), wait)


def fetch_tensor(tensor: "torch.Tensor", wait: bool = True) -> None:
    """Brings the tensor's storage back to device memory."""
    _offload.fetch_pointer(tensor.untyped_storage().data_ptr(), wait)


def residency(tensor: "torch.Tensor") -> str:
    """Where the tensor's storage is: "device", "host", "split" or "moving"."""
    return _offload.residency_of(tensor.untyped_storage().data_ptr())


def _stream() -> int:
    """The current stream of the current device, as an integer: the hooks ask for it once
    per module, and torch.cuda.current_stream() builds a Stream object each time."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:
        return torch.cuda.current_stream().cuda_stream
    return raw(torch._C._cuda_getDevice())


def _pointers(tensors: Iterable["torch.Tensor"]) -> list:
    return [tensor.untyped_storage().data_ptr() for tensor in tensors]


def _begin(tensors: Iterable["torch.Tensor"], stream: int = 0) -> None:
    """Use-begins hints for the tensors, in one call into the library."""
    _offload.use_begins_many(_pointers(tensors), stream or _stream())


def _end(tensors: Iterable["torch.Tensor"], stream: int = 0) -> None:
    _offload.use_ends_many(_pointers(tensors), stream or _stream())


def _move_into_class(tensor: "torch.Tensor", name: str) -> "torch.Tensor":
    with allocation_class(name):
        moved = torch.empty_like(tensor)
    moved.copy_(tensor)
    return moved


class OffloadHandle:
    """What offload() installed; remove() takes the hooks out again."""

    def __init__(self, hooks: list, optimizer, original_step):
        self._hooks = hooks
        self._optimizer = optimizer
        self._original_step = original_step

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._optimizer is not None:
            self._optimizer.step = self._original_step
            self._optimizer = None


def _offload_setting() -> str:
    """ZEROALLOC_OFFLOAD as the library parsed it (asks no device for anything)."""
    from zeroalloc._library import library, read_json
    for option in read_json(library().zeroalloc_options_json).get("options", []):
        if option.get("name") == "ZEROALLOC_OFFLOAD":
            return (option.get("value") or option.get("default") or "none").strip().lower()
    return "none"


def _require_offload_engine() -> None:
    if _offload_setting() != "host":
        raise ZeroallocError(
            "zeroalloc.torch.offload() needs the offload engine: set ZEROALLOC_OFFLOAD=host "
            "in the environment before the process starts (and zeroalloc as PyTorch's "
            "allocator: zeroalloc.torch.install() or ZEROALLOC_TORCH=zeroalloc)")


#: Bumped whenever a parameter is adopted: the automatic mode's per-module group decisions,
#: made from the managed bytes under a module, are stale after that.
_adoptions = [0]


def _adopt(parameters, optimizer=None) -> list:
    """Moves parameters (and the optimizer's existing states) into their allocation classes
    and hints the end of each parameter's backward use; returns the hooks."""
    hooks = []
    with torch.no_grad():
        for parameter in parameters:
            if not parameter.is_cuda or getattr(parameter, "_zeroalloc_adopted", False):
                continue
            parameter.data = _move_into_class(parameter.data, "parameter")
            parameter._zeroalloc_adopted = True
            _adoptions[0] += 1
            if parameter.requires_grad:
                hooks.append(parameter.register_post_accumulate_grad_hook(_end_backward))
        if optimizer is not None:
            for state in optimizer.state.values():
                for key, value in list(state.items()):
                    if torch.is_tensor(value) and value.is_cuda:
                        state[key] = _move_into_class(value, "optimizer_state")
    return hooks


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
    task = _graph_task()
    if task is None:  # a PyTorch without graph task ids: as before, one begin per hook
        _begin(own)
        return
    begun = _backward_open.get(task)
    if begun is None:
        begun = _backward_open[task] = {}
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda task=task: _close_backward(task))
    fresh = [p for p in own if id(p) not in begun]
    for parameter in fresh:
        begun[id(parameter)] = parameter
    if fresh:
        _begin(fresh)


def _end_backward(parameter) -> None:
    """The post-accumulate-grad hook: ends the backward use this backward began."""
    task = _graph_task()
    if task is None:
        if not hasattr(torch._C, "_current_graph_task_id"):
            _end((parameter,))  # no task ids: uses were begun untracked
        return
    begun = _backward_open.get(task)
    if begun is not None and begun.pop(id(parameter), None) is not None:
        _end((parameter,))


def _close_backward(task) -> None:
    """At the end of a backward: ends the uses it began and never accumulated into."""
    left = list(_backward_open.pop(task, {}).values())
    if left:
        _end(left)


#: graph task id -> {id(parameter): parameter} begun in that backward, not yet ended.
_backward_open: dict = {}


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
        _begin(own)

    def after(self, _module, _inputs, output) -> None:  # always called, also on an error
        begun = self.open()
        if not begun:
            return  # its pre-hook never ran (an earlier pre-hook raised)
        own = begun.pop()
        _end(own)
        if output is not None:
            _hint_backward(own, output)

    def member_before(self, module, inputs) -> None:
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

    def stack(self) -> list:
        found = getattr(self.local, "stack", None)
        if found is None:
            found = self.local.stack = []
        return found

    def before(self, module, inputs) -> None:
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
            window_bytes: int = 1 << 30, hint_group_bytes: int = 256 << 20) -> OffloadHandle:
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
    a time (PyTorch's foreach and fused optimizers would touch every state at once).
    Needs ZEROALLOC_OFFLOAD=host in the environment before the library loads."""
    _require_offload_engine()
    hooks = _adopt(model.parameters(), optimizer)
    hooks += _install_hint_hooks(model, hint_group_bytes)
    original_step = optimizer.step if optimizer is not None else None
    if optimizer is not None:
        optimizer.step = _windowed_step(optimizer, original_step, window_bytes)
        _readopt_after_load(optimizer)
    return OffloadHandle(hooks, optimizer, original_step)


def enable_automatic_offload(window_bytes: int = 1 << 30,
                             hint_group_bytes: int = 256 << 20) -> None:
    """Offload with no line changed in the training script (ZEROALLOC_OFFLOAD=host with the
    package's start-up hook): every optimizer created from now on has its parameters and
    states managed as offload() does, and global module hooks send the use hints, grouped
    as offload() groups them (Note [Hint groups])."""
    _require_offload_engine()
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
        _adopt(parameters, self)
        self.step = _windowed_step(self, self.step, window_bytes)
        _readopt_after_load(self)

    torch.optim.Optimizer.__init__ = init


def _remove(entries: list, entry) -> None:
    """Removes `entry` by identity (== on entries would compare tensors)."""
    for index, each in enumerate(entries):
        if each is entry:
            del entries[index]
            return


def _windowed_step(optimizer, original_step, window_bytes: int):
    """optimizer.step in windows of about `window_bytes` of parameters and states, as a bound
    method (LR schedulers wrap it through __func__ and __self__).

    Note [Stepping states where they are]: optimizer states are touched once per step, in one
    pass, so they are not fetched (a remap of host memory costs more than the transfer): each
    window's states are pinned where they are (use_in_place); those on the host are copied
    into device scratch on one stream while the previous window steps, stepped there by the
    optimizer's own kernels, and copied back on another stream. Copies in and out overlap
    each other and the kernels; the results are bit for bit those of a step on the device
    (bench/python/optimizer_step_bench.py compares this with stepping over PCIe, with
    fetching and evicting, and with a CPU Adam). States that are not contiguous, or do not
    fit the scratch sized before the step, are reached where they are. The step's
    temporaries (foreach intermediates) are allocated with the activations; states the step
    creates move into the optimizer-state class after their window. Every hint opened is
    closed, and the copies are waited for in the step's stream, also when a window fails.
    Note [Windows and buffers]: copies in and out run at once, each at the PCIe rate, while
    the kernels take a fraction of that. A window's copy out follows its copy in and its
    step, so the step costs the bytes bounced one way plus about one window (the out stream
    waits for the first, the in stream has nothing left during the last). Smaller windows
    shorten that and add per-window costs (Python, launches): from 128 MiB to 1 GiB the step
    measured the same (bench/RESULTS.md). Ramping the sizes at the ends does not help: the
    out stream then waits for the first large window instead. With two scratch buffers a
    window's copy in would wait for the write-back of the window just before it, which
    waits for that window's step, adding half a window's kernels to every window; with
    three it waits for one long done.
    Known limits: the optimizer's step hooks (register_step_pre_hook / post_hook) run once
    per window, with the window's parameters in param_groups; an optimizer whose parameters
    span several devices steps in one piece, without windows."""
    if getattr(original_step, "_zeroalloc_windowed", False):
        return original_step  # offload() and the automatic mode never wrap twice
    streams: dict = {}  # device index -> (copy in, copy out)
    warned: list = []  # the several-devices warning, once

    def state_items(parameter):
        return [(key, value) for key, value in optimizer.state.get(parameter, {}).items()
                if torch.is_tensor(value) and value.is_cuda and value.dim() > 0
                and value.numel() > 0]

    def windows(groups):
        """Windows over the parameters with gradients, from the groups as they were before
        any window narrowed them."""
        found, current, size = [], [], 0
        for params in groups:
            for parameter in params:
                if parameter.grad is None:
                    continue
                cost = parameter.numel() * parameter.element_size() * 3  # + two Adam states
                if current and size + cost > window_bytes:
                    found.append(current)
                    current, size = [], 0
                current.append(parameter)
                size += cost
        if current:
            found.append(current)
        return found

    def where(tensor) -> str:
        """The tensor's residency; "foreign" for memory the engine does not manage."""
        try:
            return _offload.residency_of(tensor.untyped_storage().data_ptr())
        except ZeroallocError:
            return "foreign"

    def padded(nbytes: int) -> int:
        return -(-nbytes // 512) * 512

    def residencies(found) -> dict:
        """Each state's residency at the start of the step, by id: asked once per state (a
        call into the library each). A state the engine moves before its window is pinned
        is still stepped correctly: in place if it left the device, through a redundant
        copy if it came back."""
        return {id(value): where(value) for window in found for parameter in window
                for _, value in state_items(parameter)}

    def bounced(tensor, places) -> bool:
        """Whether a state is copied through scratch: off the device, and laid out so that a
        contiguous copy has the same strides (else the kernels reach it where it is)."""
        return tensor.is_contiguous() and places[id(tensor)] not in ("device", "foreign")

    def stage(window, buffer, free, copy_in, staged, places):
        """Pins the window's states where they are and starts copying the host-resident ones
        into views of `buffer` (device scratch, once the event `free` says its last window
        is written back; what does not fit is used where it is); returns the entries
        [state dict, key, home, scratch or None, pinned], each also appended to `staged` as
        soon as it is pinned."""
        entries, offset = [], 0
        capacity = buffer.numel() if buffer is not None else 0
        found = [(optimizer.state.get(parameter, {}), key, home)
                 for parameter in window for key, home in state_items(parameter)]
        # Pinned (one call for the window) before any copy of them is queued.
        pinned_entries = []
        for state, key, home in found:
            pinned = places[id(home)] != "foreign"
            entries.append([state, key, home, None, pinned])
            if pinned:
                pinned_entries.append(entries[-1])
        if pinned_entries:
            staged.extend(pinned_entries)  # before the call: a failure still ends them
            _offload.use_in_place_many(_pointers(entry[2] for entry in pinned_entries),
                                       copy_in.cuda_stream)
        staged.extend(entry for entry in entries if not entry[4])
        for entry in entries:
            home = entry[2]
            nbytes = home.numel() * home.element_size()
            if entry[4] and bounced(home, places) and offset + padded(nbytes) <= capacity:
                entry[3] = buffer[offset:offset + nbytes].view(home.dtype).view(home.shape)
                offset += padded(nbytes)
        if offset:
            if free is not None:
                copy_in.wait_event(free)  # the buffer's last step and write-back
            with torch.cuda.stream(copy_in):
                for entry in entries:
                    if entry[3] is not None:
                        entry[3].copy_(entry[2], non_blocking=True)
        return entries

    def scratch_bytes(window, places):
        """Room for the window's bounced states: those on the device need none, and the
        buffers come out of the memory the activations just left (larger ones would make
        that class grow, and push more states to the host)."""
        return sum(padded(value.numel() * value.element_size())
                   for parameter in window for _, value in state_items(parameter)
                   if bounced(value, places))

    def adopt_new_states(fresh):
        """States the optimizer created in this window (in the step's class, "other") move
        into the optimizer-state class, where the engine may page them."""
        for parameter in fresh:
            state = optimizer.state.get(parameter, {})
            for key, value in state_items(parameter):
                state[key] = _move_into_class(value, "optimizer_state")

    def step(self, closure=None, **kwargs):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        saved = [group["params"] for group in self.param_groups]
        found = windows(saved)
        staged = []  # entries pinned and not yet ended, of this window and the next
        swapped = []  # entries whose scratch is in the state dict now
        begun = None  # the window whose parameters' use is open
        copies = None
        buffers = []
        succeeded = False
        devices = {p.device for window in found for p in window}
        if len(devices) > 1 and not warned:
            warned.append(True)
            warnings.warn("zeroalloc: the optimizer's parameters span several devices "
                          f"({sorted(str(d) for d in devices)}); its step runs in one piece, "
                          "reaching host-resident states where they are (slower)")
        try:
            if not found or len(devices) > 1:
                with allocation_class("other"):
                    original_step(**kwargs)
            else:
                device = found[0][0].device
                if device.index not in streams:
                    streams[device.index] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
                copies = streams[device.index]
                copy_in, copy_out = copies
                main = torch.cuda.current_stream(device)
                # Scratch buffers taken in turn by the windows, allocated in this step's
                # stream order: the copy streams wait for what ran before on that memory,
                # and for the last step's write-backs. Three (Note [Windows and buffers]).
                places = residencies(found)
                size = max(scratch_bytes(window, places) for window in found)
                if size:
                    with allocation_class("other"):
                        buffers = [torch.empty(size, dtype=torch.uint8, device=device)
                                   for _ in range(min(3, len(found)))]
                free = [None] * len(buffers)  # per buffer: its last write-back done
                copy_in.wait_stream(main)
                copy_in.wait_stream(copy_out)
                upcoming = stage(found[0], buffers[0] if buffers else None, None, copy_in,
                                 staged, places)
                for number, window in enumerate(found):
                    entries = upcoming
                    main.wait_stream(copy_in)
                    if number + 1 < len(found):
                        slot = (number + 1) % len(buffers) if buffers else 0
                        upcoming = stage(found[number + 1], buffers[slot] if buffers else None,
                                         free[slot] if buffers else None, copy_in, staged,
                                         places)
                    for entry in entries:
                        if entry[3] is not None:
                            entry[0][entry[1]] = entry[3]
                            swapped.append(entry)
                    chosen = {id(p) for p in window}
                    fresh = [p for p in window if not state_items(p)]
                    _begin(window, main.cuda_stream)
                    begun = window
                    for group, params in zip(self.param_groups, saved):
                        group["params"] = [p for p in params if id(p) in chosen]
                    # Temporaries of the step (foreach intermediates) go with activations.
                    with allocation_class("other"):
                        original_step(**kwargs)
                    _end(window, main.cuda_stream)
                    begun = None
                    copy_out.wait_stream(main)
                    with torch.cuda.stream(copy_out):
                        for entry in entries:
                            state, key, home, scratch, pinned = entry
                            if scratch is not None:
                                current = state[key]
                                home.copy_(current, non_blocking=True)
                                if current is not scratch:  # the optimizer replaced it
                                    current.record_stream(copy_out)
                                state[key] = home
                                _remove(swapped, entry)
                        # Every end on copy_out, which follows main: the chunk's fence
                        # covers both the step and the write-back.
                        _offload.use_ends_many(
                            _pointers(entry[2] for entry in entries if entry[4]),
                            copy_out.cuda_stream)
                        ended = {id(entry) for entry in entries}
                        staged[:] = [entry for entry in staged if id(entry) not in ended]
                        if buffers:
                            free[number % len(buffers)] = torch.cuda.Event()
                            free[number % len(buffers)].record(copy_out)
                    adopt_new_states(fresh)  # after the write-backs: a failure here loses none
            succeeded = True
        finally:
            for state, key, home, _, _ in swapped:  # a window failed: its states stay as they were
                state[key] = home
            for group, params in zip(self.param_groups, saved):
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
            # Pinned by a window that failed or never ran.
            _offload.use_ends_many(_pointers(entry[2] for entry in staged if entry[4]), fence)
            if begun is not None:
                _end(begun, fence)
            del buffers
            if wait_error is not None and succeeded:
                raise wait_error
        _offload.step_boundary()
        _HintGroup.reset_all()
        for hints in _automatic:
            hints.reset()
        return loss

    step._zeroalloc_windowed = True
    return types.MethodType(step, optimizer)


def _readopt_after_load(optimizer) -> None:
    """optimizer.load_state_dict rebuilds the states in the default class: move them back
    into the optimizer-state class, where the engine may page them."""
    if getattr(optimizer.load_state_dict, "_zeroalloc_readopts", False):
        return
    original_load = optimizer.load_state_dict

    def load_state_dict(self, state_dict):
        original_load(state_dict)
        _adopt([], self)

    load_state_dict._zeroalloc_readopts = True
    optimizer.load_state_dict = types.MethodType(load_state_dict, optimizer)
