"""Methods stored on their own instance without holding it: the windowed step and the
state-dict wrappers on an optimizer, and putting the optimizer's own methods back."""

from __future__ import annotations

import inspect
import types
import weakref


class BoundWeakly:
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


def bound_to(method, instance) -> bool:
    """Whether `method` is a method of `instance` (bound, or weakly bound)."""
    return getattr(method, "__self__", None) is instance and hasattr(method, "__func__")


def unbound(method, instance):
    """`method` as a function of the instance, holding no reference to `instance` (Note [No
    cycles through the optimizer]): a method bound to it gives its function; anything else
    (a wrapper an LR scheduler stored on it, which holds it weakly) is called as it is."""
    if bound_to(method, instance):
        return method.__func__
    return lambda _instance, *args, **kwargs: method(*args, **kwargs)


def original_of(instance, name: str):
    """What instance.name is now, to be put back later by put_back without a reference to
    `instance`: None for the class's own method, else the attribute (one bound to the
    instance is held weakly bound)."""
    current = getattr(instance, name)
    if bound_to(current, instance):
        if name not in instance.__dict__:
            return None
        return BoundWeakly(current.__func__, instance)
    return current


def put_back(instance, name: str, original) -> None:
    """Undoes a wrap of instance.name: `original` is what original_of said."""
    if original is None:
        instance.__dict__.pop(name, None)
    else:
        setattr(instance, name, original)
