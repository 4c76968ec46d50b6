"""Module hints: forward hooks that tell the offload engine when modules use their
parameters, grouped into subtrees (Note [Hint groups]), for offload()'s model or, in the
automatic mode, for every module."""

from __future__ import annotations

import threading
import weakref
from typing import NamedTuple

import torch

from zeroalloc.torch import _adoption, _settings, _use_hints
from zeroalloc.torch._backward_uses import BackwardUses, backward_uses, thread_list
from zeroalloc.torch._step_listeners import WindowedSteps, windowed_steps
from zeroalloc.torch._transient import ModuleHook


def managed(module) -> list:
    """The module's own parameters that zeroalloc manages (moved into the parameter class).
    Read from the module's parameter dict: the hooks run twice per module per step, and
    parameters(recurse=False) walks a generator with a memo set each time."""
    return [p for p in module._parameters.values()
            if p is not None and getattr(p, "_zeroalloc_adopted", False)]


# Note [Hints and torch.compile]: Dynamo traces a module's hooks into its graph, and the
# hooks' bookkeeping (thread-local stacks, the library's calls, gradient hooks on outputs)
# either breaks the trace ("already tracked for mutation") or would run once, at trace
# time. So inside a compiled region every hook returns at once: torch.compiler.is_compiling()
# is a constant there, and the graph holds nothing of them. Under ZEROALLOC_ACCESS=any
# (the default) hints only speed moves up: a compiled model's memory still moves under
# pressure, each move ordered against every kernel (Note [Moves any kernel may see] in
# lib/tier/migrator.hpp). Under ZEROALLOC_ACCESS=hinted a compiled model is not covered by
# hints; docs/known-limits.md says so.
compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)

#: Per thread: (module, watch) of the members called on their own whose forward runs,
#: innermost last.
alone = threading.local()


def alone_open() -> list:
    return thread_list(alone)


def before_forward(module, listeners: WindowedSteps, backward: BackwardUses) -> None:
    """Hints a module's own parameters as its forward begins."""
    own = managed(module)
    if own:
        listeners.module_hint(own, True)
        _use_hints.begin(own)
        alone_open().append((module, backward.watch(own)))


def after_forward(module, output, backward: BackwardUses) -> None:
    own = managed(module)
    if not own:
        return
    begun, watch = alone_open(), None
    if begun and begun[-1][0] is module:
        watch = begun.pop()[1]
        if watch is not None:
            watch.pop()
    try:
        backward.hint_backward(own, output, watch)  # first: a recomputation's uses go on
    finally:
        _use_hints.end(own)


class HintGroup:
    """Modules hinted as one (Note [Hint groups]): `top`, and the modules in `members` whose
    own parameters it hints; `covered` are the ids of the modules whose hints it makes
    (its whole subtree, or `top` alone when only `top`'s own parameters are hinted). Holds
    its modules weakly: the automatic mode keeps groups in a table keyed by module. Its
    hooks tell `listeners` of each forward and begin the backward's uses through
    `backward`."""

    _all: "weakref.WeakSet" = weakref.WeakSet()

    def __init__(self, top, members, whole_subtree: bool, listeners: WindowedSteps,
                 backward: BackwardUses):
        self.top = weakref.ref(top)
        self.members = [weakref.ref(member) for member in members]
        self.covered = {id(m) for m in top.modules()} if whole_subtree else {id(top)}
        self.listeners = listeners
        self.backward = backward
        self.local = threading.local()  # per thread: the parameter lists begun, innermost last
        HintGroup._all.add(self)

    def __deepcopy__(self, memo):
        """A copy of the model (an EMA, torch.optim.swa_utils.AveragedModel) copies its
        hooks, and this with them: the copy is not offload()'s, so its group hints nothing
        (copied whole, its thread-local state could not be copied at all)."""
        inert = object.__new__(HintGroup)
        inert.top = lambda: None
        inert.members = []
        inert.covered = set()
        inert.listeners = self.listeners
        inert.backward = self.backward
        inert.local = threading.local()
        return inert

    def open(self) -> list:
        found = getattr(self.local, "open", None)
        if found is None:
            found = self.local.open = []
        return found

    def parameters(self) -> list:
        return [p for ref in self.members if (member := ref()) is not None
                for p in managed(member)]

    def before(self, _module, _inputs) -> None:
        if compiling():  # Note [Hints and torch.compile]
            return
        own = self.parameters()
        if not own:  # nothing of its own left (a copy's group, or its modules are gone)
            self.open().append((own, None))
            return
        self.listeners.module_hint(own, True)
        _use_hints.begin(own)
        self.open().append((own, self.backward.watch(own)))

    def after(self, _module, _inputs, output) -> None:  # always called, also on an error
        if compiling():  # Note [Hints and torch.compile]
            return
        begun = self.open()
        if not begun:
            return  # its pre-hook never ran (an earlier pre-hook raised)
        own, watch = begun.pop()
        if watch is not None:
            watch.pop()
        if not own:
            return
        # The backward's first: a recomputation inside a backward begins its uses at once,
        # while the forward's still hold the chunks (ended first, they could be parked and
        # fetched again in between); a checkpoint's recomputation may stop early by raising.
        try:
            if output is not None or watch is not None:
                self.backward.hint_backward(own, output, watch)
        finally:
            _use_hints.end(own)

    def member_before(self, module, _inputs) -> None:
        if compiling():  # Note [Hints and torch.compile]
            return
        self.listeners.finish_write_backs()
        if not self.open():  # called on its own, outside `top`'s forward (in this thread)
            before_forward(module, self.listeners, self.backward)

    def member_after(self, module, _inputs, output) -> None:
        if compiling():  # Note [Hints and torch.compile]
            return
        if not self.open():
            after_forward(module, output, self.backward)

    @staticmethod
    def reset_all() -> None:
        """Closes what forwards that raised left open (PyTorch before 2.1 does not call a
        forward hook then); the uses themselves the engine closes at the step boundary."""
        global alone
        for group in list(HintGroup._all):
            group.local = threading.local()
        alone = threading.local()  # every thread's, as the groups' above


def managed_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters()
               if getattr(p, "_zeroalloc_adopted", False))


def new_group(module, group_bytes: int, listeners: WindowedSteps, backward: BackwardUses):
    """The group `module` heads when no enclosing group covers it: its whole subtree when
    that holds at most `group_bytes` of managed parameters (or it has no children), else its
    own parameters alone; None when that is nothing."""
    total = managed_bytes(module)
    if total == 0:
        return None
    if total <= group_bytes or not any(True for _ in module.children()):
        return HintGroup(module, [m for m in module.modules() if managed(m)], True,
                         listeners, backward)
    return HintGroup(module, [module], False, listeners, backward) if managed(module) else None


class HeadedGroup(NamedTuple):
    """The group a module heads, as decided after a number of adoptions."""

    adoptions: int
    group: "HintGroup | None"


#: module -> HeadedGroup: kept off the module, which may be pickled; the groups hold their
#: modules weakly, so a dropped model is freed.
groups_headed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def group_of(module, group_bytes: int, listeners: WindowedSteps, backward: BackwardUses):
    """new_group, decided once per module and adoption."""
    cached = groups_headed.get(module)
    if cached is not None and cached.adoptions == _adoption.adoptions[0]:
        return cached.group
    group = new_group(module, group_bytes, listeners, backward)
    groups_headed[module] = HeadedGroup(_adoption.adoptions[0], group)
    return group


class AutomaticHints:
    """The automatic mode's global module hooks, with the grouping of Note [Hint groups]: a
    module the running group covers does nothing (one set lookup); any other module hints
    the group it heads. Parents run their pre-hooks before their children, so the largest
    subtree within the size is found from the top."""

    def __init__(self, group_bytes: int, listeners: WindowedSteps = windowed_steps,
                 backward: BackwardUses = backward_uses):
        self.group_bytes = group_bytes
        self.listeners = listeners
        self.backward = backward
        self.local = threading.local()  # the groups whose forward runs, innermost last
        backward.guard()
        backward.saved_only = _settings.backward_uses_saved_only()

    def stack(self) -> list:
        found = getattr(self.local, "stack", None)
        if found is None:
            found = self.local.stack = []
        return found

    def before(self, module, inputs) -> None:
        if compiling():  # Note [Hints and torch.compile]
            return
        self.listeners.finish_write_backs()
        stack = self.stack()
        if stack and id(module) in stack[-1].covered and module is not stack[-1].top():
            return
        group = group_of(module, self.group_bytes, self.listeners, self.backward)
        if group is not None:
            stack.append(group)
            group.before(module, inputs)

    def after(self, module, inputs, output) -> None:  # always called, also on an error
        if compiling():  # Note [Hints and torch.compile]
            return
        stack = self.stack()
        if stack and stack[-1].top() is module:
            stack.pop().after(module, inputs, output)

    def reset(self) -> None:
        self.local = threading.local()


automatic: list = []  # the automatic mode's hooks, once enabled


def forget_open_forwards() -> None:
    """At a step boundary: forgets what forwards that raised left open (the engine closed
    the uses themselves)."""
    HintGroup.reset_all()
    for hints in automatic:
        hints.reset()


def always_called(register, hook):
    """Registers a forward hook that runs also when the forward raises (PyTorch 2.1 on;
    before, what a raising forward left open is closed at the step's end)."""
    try:
        return register(hook, always_call=True)
    except TypeError:
        return register(hook)


def hint_groups(model, group_bytes: int, listeners: WindowedSteps,
                backward: BackwardUses) -> list:
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
        group = new_group(module, group_bytes, listeners, backward)
        if group is not None:
            groups.append(group)
        if group is None or group.covered == {id(module)}:
            for child in module.children():
                visit(child)
        else:
            seen.update(group.covered)

    visit(model)
    return groups


def install_hint_hooks(model, group_bytes: int, listeners: WindowedSteps = windowed_steps,
                       backward: BackwardUses = backward_uses) -> list:
    """The module hooks of offload(): each group's top hints the group; its members hint
    themselves when called outside the group's forward. Returns the hook handles."""
    backward.guard()
    backward.saved_only = _settings.backward_uses_saved_only()
    hooks = []
    for group in hint_groups(model, group_bytes, listeners, backward):
        top = group.top()
        hooks.append(top.register_forward_pre_hook(ModuleHook(group.before)))
        hooks.append(always_called(top.register_forward_hook, ModuleHook(group.after)))
        for member in (ref() for ref in group.members):
            if member is not top:
                hooks.append(member.register_forward_pre_hook(ModuleHook(group.member_before)))
                hooks.append(always_called(member.register_forward_hook,
                                           ModuleHook(group.member_after)))
    return hooks
