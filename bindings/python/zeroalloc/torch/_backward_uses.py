"""The backward's use hints of parameters (Note [Backward uses]): begun at the first
gradient of a module's outputs, ended when the parameter's gradient is accumulated, and
what a backward began and never accumulated into ended when that backward ends; only for
the parameters autograd saved for the backward (Note [The backward reads what autograd
saved])."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Mapping

import torch

from zeroalloc.torch import _use_hints
from zeroalloc.torch._step_listeners import WindowedSteps, windowed_steps


def graph_task():
    """The id of the backward running in this thread (None outside one, or on a PyTorch
    without graph task ids)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    task = current() if current is not None else -1
    return None if task == -1 else task


class SavedWatch:
    """Note [The backward reads what autograd saved]: a backward kernel reads a parameter
    only through what autograd saved for it, so a module's forward tells which of its
    parameters its backward will read: those the pack hook of saved tensors saw (the
    parameter, a view of it, or any tensor sharing its storage: .data, detach()). Under
    autocast a Linear saves the bf16 copy of its weight, not the fp32 weight, and an
    Embedding saves its indices; their backward uses fetched the fp32 parameters only to
    leave them unread (the 1.3B bench at 13.3 GiB moved 15.2 GiB a step, 5.97 without
    them: bench/RESULTS.md). A parameter the forward did not save gets no backward use: it
    stays where it is until the step. A backward that reads a parameter autograd never
    saved (an autograd.Function keeping it as an attribute of its ctx instead of
    save_for_backward) would read a parked chunk: ZEROALLOC_BACKWARD_USES=all is the way
    out (docs/known-limits.md says when).

    Saved-tensor hooks are one stack per thread that other code pushes on too (save_on_cpu,
    checkpoints, activation offloading pushed from module hooks in any order), so the watch
    stays out of their way: it is pushed as the module's forward begins only when the
    stack is empty or holds another watch on top (nested modules), and then it counts
    every parameter as saved if any other hooks are pushed while it is open (they would
    hide what they save from it: `watch_pushes` wraps the push). Popped as the forward ends;
    if something else sits above it then, it is taken out from under it and the rest put
    back. Under hooks of other code, every parameter counts as saved, as before this note.
    The pack hook keeps each tensor detached (the tensor itself would make a reference
    cycle of an output saved by its own node) with its version, and the unpack hook checks
    the version as autograd does without hooks (modified in place since: an error, not a
    wrong gradient). A forward inside a backward (a checkpoint's recomputation) begins the
    uses of what it saved at once: a non-reentrant checkpoint drops its recomputed outputs
    (their gradients never come) and may stop the recomputation by raising."""

    __slots__ = ("own", "ids", "storages", "saved", "pushed", "everything")

    def __init__(self, own: list):
        self.own = own
        self.ids = {id(p) for p in own}
        self.storages: "dict | None" = None  # own's storages -> ids, made at first need
        self.saved: set = set()  # ids of the parameters seen saved
        self.pushed = False
        self.everything = False

    def push(self) -> "SavedWatch":
        hooks = torch._C._autograd
        try:
            if not hooks._saved_tensors_hooks_is_enabled():
                self.everything = True
                return self
            top = hooks._top_saved_tensors_default_hooks(True)
            if top is not None and not isinstance(getattr(top[0], "__self__", None),
                                                  SavedWatch):
                self.everything = True  # other code's hooks: not ours to stand in for
                return self
            original_push(self.pack, self.unpack)
            self.pushed = True
            open_watches().append(self)
        except Exception:  # noqa: BLE001 (a PyTorch without these: every parameter is read)
            self.everything = True
        return self

    def pop(self) -> None:
        if not self.pushed:
            return
        self.pushed = False
        watches = open_watches()
        if self in watches:
            watches.remove(self)
        hooks = torch._C._autograd
        above = []
        while (top := hooks._top_saved_tensors_default_hooks(True)) is not None:
            hooks._pop_saved_tensors_default_hooks()
            if top[0] == self.pack:
                break
            above.append(top)
        else:
            self.everything = True  # gone already (popped by someone else's exit)
        if above:
            self.everything = True
        for pack, unpack in reversed(above):
            original_push(pack, unpack)

    def pack(self, tensor):
        try:
            base = tensor._base
            if id(tensor) in self.ids:
                self.saved.add(id(tensor))
            elif base is not None and id(base) in self.ids:
                self.saved.add(id(base))
            else:  # .data or detach() of a parameter, or a view of one, shares its storage
                if self.storages is None:
                    self.storages = {}
                    for p in self.own:
                        self.storages.setdefault(p.untyped_storage().data_ptr(), []).append(id(p))
                found = self.storages.get(tensor.untyped_storage().data_ptr())
                if found is not None:
                    self.saved.update(found)
        except Exception:  # noqa: BLE001 (a tensor without storage: assume it is one)
            self.everything = True
        return tensor.detach(), tensor._version

    @staticmethod
    def unpack(packed):
        tensor, version = packed
        if tensor._version != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: [{tensor.type()} {list(tensor.shape)}] is at version "
                f"{tensor._version}; expected version {version} instead")
        return tensor

    def needed(self) -> list:
        """The parameters the backward will read."""
        if self.everything:
            return self.own
        return [p for p in self.own if id(p) in self.saved]


#: Per thread: the watches open, innermost last.
watching = threading.local()


def thread_list(local: threading.local) -> list:
    """The list `local.open` of this thread, made empty at its first use."""
    found = getattr(local, "open", None)
    if found is None:
        found = local.open = []
    return found


def open_watches() -> list:
    return thread_list(watching)


def watch_pushes():
    """Wraps the push of saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks and
    every context built on it call it by name), once: hooks of other code pushed while
    watches are open make those watches count every parameter as saved."""
    global original_push
    hooks = torch._C._autograd
    push = getattr(hooks, "_push_saved_tensors_default_hooks", None)
    if push is None or getattr(push, "_zeroalloc_watching", False):
        return

    def pushed(pack, unpack):
        if not isinstance(getattr(pack, "__self__", None), SavedWatch):
            for watch in getattr(watching, "open", ()):
                watch.everything = True
        return push(pack, unpack)

    pushed._zeroalloc_watching = True
    original_push = push
    hooks._push_saved_tensors_default_hooks = pushed


#: The push watch_pushes wrapped (read then, not at import: the start-up hook imports this
#: package while torch itself is being imported).
original_push = None


def output_tensors(output, found: list, depth: int = 0) -> list:
    """The tensors that require grad in a module's output: a tensor, or tensors inside
    tuples, lists and mappings (a transformers ModelOutput is a mapping), a few levels deep."""
    if torch.is_tensor(output):
        if output.requires_grad and output.grad_fn is not None:  # a leaf's hook would stay
            found.append(output)
    elif depth < 4 and isinstance(output, (tuple, list, Mapping)):
        for each in (output.values() if isinstance(output, Mapping) else output):
            output_tensors(each, found, depth + 1)
    return found


class BackwardUses:
    """Note [Backward uses]: a parameter's backward use begins when the backward reaches the
    first module using it (a hook on that module's output gradient) and ends when its
    gradient is accumulated (after every use of it in the graph). So it begins once per
    backward: a module called twice, a weight tied between two modules and a layer
    recomputed under checkpointing would begin it again. And what the backward began and
    did not accumulate into (frozen parameters, experts no token reached, autograd.grad,
    the outer backward around a reentrant checkpoint's inner one) ends when that backward
    ends: open, it would pin its chunks until the step's end, or for good outside training.

    The hooks tell `listeners` (the windowed steps) of each backward module hint and each
    accumulation."""

    def __init__(self, listeners: WindowedSteps):
        self.listeners = listeners
        #: graph task id -> {id(parameter): weak reference to it} begun in that backward,
        #: not yet ended.
        self.open: dict = {}
        self.lock = threading.Lock()  # the autograd threads of several devices may begin one task
        #: Note [The backward reads what autograd saved]: whether the forward hooks watch
        #: what autograd saves (ZEROALLOC_BACKWARD_USES=saved), set when hooks are installed.
        self.saved_only = False

    def watch(self, own: list) -> "SavedWatch | None":
        """A watch of what the forward about to run saves of `own`, pushed; None when every
        parameter gets a backward use."""
        if not self.saved_only or not hasattr(torch._C, "_current_graph_task_id"):
            return None  # (without task ids an accumulation ends a use it never began)
        watch_pushes()
        return SavedWatch(own).push()

    def __deepcopy__(self, memo):
        return self  # one per process: a copy of a hook holding it (a model's) shares it

    def begin(self, own: list, needed: "list | None" = None) -> None:
        """Begins the backward use of the parameters `needed` (`own` when None), once per
        backward; the listeners hear of all of `own`."""
        self.listeners.module_hint(own, False)
        own = own if needed is None else needed
        if not own:
            return
        task = graph_task()
        if task is None:  # a PyTorch without graph task ids: as before, one begin per hook
            _use_hints.begin(own)
            return
        with self.lock:
            begun = self.open.get(task)
            if begun is None:
                begun = self.open[task] = {}
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda task=task: self.close(task))
            fresh = [p for p in own if id(p) not in begun]
            for parameter in fresh:
                begun[id(parameter)] = weakref.ref(parameter)  # a dropped model must not wait
        if fresh:  # outside the lock: the hint may wait for a fetch
            _use_hints.begin(fresh)

    def end(self, parameter) -> None:
        """The post-accumulate-grad hook: ends the backward use this backward began."""
        task = graph_task()
        self.listeners.accumulated(parameter, task)
        if task is None:
            # No task ids: uses were begun untracked, for managed parameters only.
            if (not hasattr(torch._C, "_current_graph_task_id")
                    and getattr(parameter, "_zeroalloc_adopted", False)):
                _use_hints.end((parameter,))
            return
        # Every backward that began it: a reentrant checkpoint's recomputation begins a use
        # in the outer backward, and the gradient is accumulated in the inner one.
        with self.lock:
            ended = sum(begun.pop(id(parameter), None) is not None
                        for begun in self.open.values())
        for _ in range(ended):
            _use_hints.end((parameter,))

    def close(self, task) -> None:
        """At the end of a backward: ends the uses it began and never accumulated into."""
        left = [parameter for parameter in (reference() for reference in
                                            self.open.pop(task, {}).values())
                if parameter is not None]
        if left:
            _use_hints.end(left)

    def forget_all(self) -> None:
        """After a step boundary, which closed every use: a backward that raised never ran
        the callback that forgets what it began (and holds those parameters)."""
        self.open.clear()

    def hint_backward(self, own: list, output, watch: "SavedWatch | None" = None) -> None:
        """Backward of a module begins when the first gradient of its outputs arrives: one
        use-begins per backward, whichever output it comes through, for the parameters
        `watch` saw saved (all of `own` without one)."""
        needed = None if watch is None else watch.needed()
        if watch is not None and needed and graph_task() is not None:
            self.begin(own, needed)  # a recomputation inside a backward: read from now on
        tensors = output_tensors(output, [])
        if not tensors:
            return
        if len(tensors) > 1:
            try:  # once per backward, on the first of the outputs' gradients (PyTorch 2.2 on)
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grad: self.begin(own, needed), mode="any")
                return
            except (AttributeError, TypeError):
                pass  # then the first output's gradient, as for a single output
        tensors[0].register_hook(lambda grad: (self.begin(own, needed), grad)[1])

    def closing(self, original):
        """torch.autograd.backward, ending the uses begun by a backward that raised: autograd
        runs a backward's end callback only when it succeeds, so its open uses would pin
        their chunks until the next step boundary, or for good where no optimizer steps (an
        out-of-memory retry loop, offload(model) alone). The tasks closed are those begun
        during this call, inner ones included."""

        def backward(*args, **kwargs):
            before = self.open.copy()
            try:
                return original(*args, **kwargs)
            except BaseException:
                for task in [task for task in self.open.copy() if task not in before]:
                    try:
                        self.close(task)
                    except Exception:  # the backward's own error is the one to see
                        pass
                raise

        functools.update_wrapper(backward, original)
        backward._zeroalloc_closing = True
        return backward

    def guard(self) -> None:
        """Installs `closing` once (Tensor.backward calls torch.autograd.backward)."""
        autograd = getattr(torch, "autograd", None)
        original = getattr(autograd, "backward", None)
        if original is not None and not getattr(original, "_zeroalloc_closing", False):
            autograd.backward = self.closing(original)


#: The process's backward uses, telling the process's windowed steps.
backward_uses = BackwardUses(windowed_steps)
