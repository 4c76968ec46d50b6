"""The backward's use hints of parameters (Note [Backward uses]): begun at the first
gradient of a module's outputs, ended when the parameter's gradient is accumulated, and
what a backward began and never accumulated into ended when that backward ends."""

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

    def __deepcopy__(self, memo):
        return self  # one per process: a copy of a hook holding it (a model's) shares it

    def begin(self, own: list) -> None:
        """Begins the backward use of the parameters `own`, once per backward."""
        self.listeners.module_hint(own, False)
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
            if not hasattr(torch._C, "_current_graph_task_id"):
                _use_hints.end((parameter,))  # no task ids: uses were begun untracked
            return
        begun = self.open.get(task)
        if begun is not None and begun.pop(id(parameter), None) is not None:
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

    def hint_backward(self, own: list, output) -> None:
        """Backward of a module begins when the first gradient of its outputs arrives: one
        use-begins per backward, whichever output it comes through."""
        tensors = output_tensors(output, [])
        if len(tensors) > 1:
            try:  # once per backward, on the first of the outputs' gradients (PyTorch 2.2 on)
                torch.autograd.graph.register_multi_grad_hook(
                    tensors, lambda grad: self.begin(own), mode="any")
                return
            except (AttributeError, TypeError):
                pass  # then the first output's gradient, as for a single output
        if tensors:
            tensors[0].register_hook(lambda grad, own=own: (self.begin(own), grad)[1])

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
