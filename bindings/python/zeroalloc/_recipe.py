"""What ZEROALLOC_RECIPE sets where a variable of its own does not say otherwise. It needs no
PyTorch: zeroalloc.torch's settings and `python -m zeroalloc doctor` both read it."""

from __future__ import annotations

#: The words of a yes, as the library reads them (lowercase).
YES = ("1", "true", "yes", "on")


def master_weights(chosen: "str | None", recipe: str, zero_stage: str) -> str:
    """ZEROALLOC_MASTER_WEIGHTS as set (`chosen`), else what the recipe gives: bf16 under
    fast, else none. ZeRO stages do not combine with master weights yet, so under a stage
    other than 0 the recipe leaves them out (the host step stays)."""
    if chosen is not None:
        return chosen
    return "bf16" if recipe == "fast" and zero_stage == "0" else "none"


def host_step(chosen: "str | None", recipe: str) -> bool:
    """ZEROALLOC_HOST_STEP as set (`chosen`), else what the recipe gives: on under fast,
    else off."""
    return chosen in YES if chosen is not None else recipe == "fast"
