"""The windowed steps that the hooks tell about the training loop (Note [Overlapping the
step] in _optimizer_step.py): module hints and gradient accumulations reach the steps that
move states between steps, and a hinted module's forward lets the steps that write kept
states back free their scratch. One object, handed to each hook when the hook is made."""

from __future__ import annotations

import weakref


class WindowedSteps:
    """The windowed steps the hooks reach, held weakly: a dropped optimizer takes its step,
    its states and their scratch along."""

    __slots__ = ("overlapping", "writing_back", "kept_states", "hints", "first_hint")

    def __init__(self):
        #: Steps that move states between steps: module hints and accumulations reach them.
        self.overlapping: "weakref.WeakSet" = weakref.WeakSet()
        #: Steps whose kept states are being written back: every hinted module's forward
        #: asks whether the copies are done, to free the scratch early.
        self.writing_back: "weakref.WeakSet" = weakref.WeakSet()
        #: id(tensor in a state dict) -> the step that kept it in scratch after a step.
        self.kept_states: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
        #: Module hints so far (Note [The host step finishes behind the forward]: a step may
        #: leave work behind only where hints ran since the last one).
        self.hints = 0
        #: Steps told of the first module hint after them, whatever they overlap (Note
        #: [Pinned buffers made ahead] in _host_step.py: made from the first forward on).
        self.first_hint: "weakref.WeakSet" = weakref.WeakSet()

    def __deepcopy__(self, memo):
        return self  # one per process: a copy of a hook holding it (a model's) shares it

    def module_hint(self, own: list, forward: bool) -> None:
        """A forward or backward module hint for the parameters `own`: windowed steps learn
        that a training loop runs, and write back what the last step kept on the device; a
        forward of their own model outside any backward (not a checkpointed layer's
        recomputation) drops what was staged for a step that did not come."""
        self.hints += 1
        if self.first_hint:
            for stepper in tuple(self.first_hint):
                self.first_hint.discard(stepper)
                stepper.first_hint()
        if not self.overlapping:  # asked on every hinted module: no iteration when empty
            return
        for stepper in tuple(self.overlapping):
            stepper.module_hint(own, forward)

    def accumulated(self, parameter, task) -> None:
        """A gradient accumulation into `parameter`, in the backward `task`: the steps that
        step it may stage their first windows."""
        if not self.overlapping:
            return
        for stepper in tuple(self.overlapping):
            if id(parameter) in stepper.members:
                stepper.accumulated(task)

    def finish_write_backs(self) -> None:
        """Puts back the state tensors of kept states whose write-back is done, freeing their
        scratch."""
        if not self.writing_back:  # the automatic mode asks at every module's forward
            return
        for stepper in tuple(self.writing_back):
            stepper.write_back_kept(wait=False)

    def repin(self) -> None:
        """After a step boundary, which closed every use: each step pins again what it
        holds between steps."""
        for stepper in tuple(self.overlapping):
            stepper.repin()

    def keeping(self, tensor):
        """The step that kept `tensor` (a state dict's) in scratch after a step, or None."""
        return self.kept_states.get(id(tensor))


#: The process's windowed steps; the hooks and steps are handed it when they are made.
windowed_steps = WindowedSteps()
