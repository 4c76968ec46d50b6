"""Step boundaries for a program that only made zeroalloc its allocator (install): each
optimizer step marks one (zeroalloc_step_boundary), so that reports show the run step by
step. Optimizers under zt.offload mark their own boundary at the end of their windowed step
and are left out here (a windowed step calls the optimizer's own step once per window)."""

from __future__ import annotations

from zeroalloc import _offload

_handle = None  # the global post-hook's, while it is registered


def _mark(optimizer, args, kwargs) -> None:
    if getattr(optimizer, "_zeroalloc_stepper", None) is None:
        _offload.step_boundary()
        # The boundary closed every use, also those the windowed steps of optimizers under
        # zt.offload hold between their steps: pinned again, as their own boundary does.
        from zeroalloc.torch._step_listeners import windowed_steps
        windowed_steps.repin()


def mark_every_optimizer_step() -> None:
    """Registers the global optimizer post-hook that marks a step boundary after each step
    of an optimizer zt.offload does not manage. Once per process: later calls do nothing."""
    global _handle
    if _handle is None:
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except ImportError:  # a torch without global optimizer hooks: no step marks
            return
        _handle = register_optimizer_step_post_hook(_mark)


def stop_marking() -> None:
    """Removes the hook (tests)."""
    global _handle
    if _handle is not None:
        _handle.remove()
        _handle = None
