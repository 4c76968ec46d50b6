"""What zeroalloc leaves on a program's own objects, made so that it does not travel with them.

Note [Nothing of ours is pickled]: a program may pickle its whole model (`torch.save(model)`)
or deep-copy it (an EMA copy). Its modules' hook dictionaries and its parameters' attributes
go along. offload()'s hooks hold weak references and locks, which pickle refuses: the save
failed where it works natively. Its marks on parameters would tell the copy's parameters
that they are managed and hooked when they are neither. So a module hook of offload() is a
ModuleHook, which comes back inert, and a mark is MARK, which comes back as None. The copy
is then what a new model is to zeroalloc: an offload() of it, or the automatic mode, manages
it from scratch.
"""

from __future__ import annotations


class ModuleHook:
    """A hook offload() registers on a program's module. Pickled or deep-copied with the
    module, it comes back inert (Note [Nothing of ours is pickled]). It takes the attributes
    PyTorch sets on hooks."""

    def __init__(self, call):
        self.call = call

    def __call__(self, *args, **kwargs):
        return None if self.call is None else self.call(*args, **kwargs)

    def __reduce__(self):
        return (ModuleHook, (None,))


class Mark(int):
    """True on the object marked; None once pickled or deep-copied with it."""

    def __reduce__(self):
        return (type(None), ())

    def __repr__(self) -> str:
        return "MARK"


MARK = Mark(1)
