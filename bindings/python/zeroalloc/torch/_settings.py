"""The library's settings that offload() and the automatic mode read, checked by the
library's own parser."""

from __future__ import annotations

from zeroalloc import _recipe
from zeroalloc._library import ZeroallocError, library, read_json


def _option(name: str) -> dict:
    """The library's reading of the variable `name` (its value, None when unset, and its
    default), checked by its own parser (asks no device for anything). The library read its
    settings once, at its first call: change them before that, not after."""
    report = read_json(library().zeroalloc_options_json)
    if not report.get("valid", True):
        raise ZeroallocError(report.get("error") or f"{name} could not be read")
    for option in report.get("options", []):
        if option.get("name") == name:
            return option
    return {}


def setting(name: str, fallback: str) -> str:
    """The variable `name` as the environment holds it now, checked by the library's own
    parser, else its default, else `fallback`."""
    option = _option(name)
    return (option.get("value") or option.get("default") or fallback).strip().lower()


def prefetch_headroom_bytes() -> int:
    """The device memory the offload engine keeps free for fetches ahead
    (ZEROALLOC_PREFETCH_BYTES). A placement under a limit can count on the limit less this."""
    from zeroalloc.doctor import _byte_size
    return _byte_size(setting("ZEROALLOC_PREFETCH_BYTES", "512MiB")) or 0


def setting_if_set(name: str) -> "str | None":
    """The variable `name` as the environment holds it, checked, or None when it is unset."""
    value = _option(name).get("value")
    return value.strip().lower() if value and value.strip() else None


#: The words of a yes, as the library reads them (lowercase).
YES = _recipe.YES


def enabled(name: str, fallback: str) -> bool:
    """A yes-or-no variable, checked as the library checks it."""
    return setting(name, fallback) in YES


def offload_setting() -> str:
    """ZEROALLOC_OFFLOAD, checked as the library checks it."""
    return setting("ZEROALLOC_OFFLOAD", "none")


def gradient_class_default() -> "bool | str":
    """ZEROALLOC_OFFLOAD_GRADIENTS, checked as the library checks it (the library rejects a
    value that is not auto, a yes or a no at start-up): what offload() and the automatic mode
    do with gradients when `gradient_class` is not given: True, False or "auto" (Note
    [Gradients' class, decided] in _gradient_choice.py)."""
    value = setting("ZEROALLOC_OFFLOAD_GRADIENTS", "auto")
    return "auto" if value == "auto" else value in YES


def any_access() -> bool:
    """ZEROALLOC_ACCESS (default any): whether any kernel may touch the memory the engine
    moves, at any time (Note [Moves any kernel may see] in lib/tier/migrator.hpp). What the
    hints alone would allow is then off: parked parameters, and the host step finishing
    behind the next forward."""
    return setting("ZEROALLOC_ACCESS", "any") != "hinted"


def parameters_park() -> bool:
    """ZEROALLOC_PARK_PARAMETERS (default 1) under ZEROALLOC_ACCESS=hinted: whether evicted
    parameters may be parked behind unmapped addresses (Note [Parameters parked] in
    lib/tier/offload_engine.hpp). Never under ZEROALLOC_ACCESS=any."""
    return not any_access() and enabled("ZEROALLOC_PARK_PARAMETERS", "1")


def recipe() -> str:
    """ZEROALLOC_RECIPE (default exact): what the package may change in the numbers to train
    faster. exact: nothing. fast: master weights in bf16 and the host step, unless their own
    variables say otherwise (Note [The fast recipe, advised] in _recipe_advice.py)."""
    return setting("ZEROALLOC_RECIPE", "exact")


def master_weights() -> str:
    """ZEROALLOC_MASTER_WEIGHTS as set, else what the recipe gives: bf16 under fast, else
    none. ZeRO stages do not combine with master weights yet, so under ZEROALLOC_ZERO_STAGE
    the recipe leaves them out (the host step stays)."""
    return _recipe.master_weights(setting_if_set("ZEROALLOC_MASTER_WEIGHTS"), recipe(),
                                  setting("ZEROALLOC_ZERO_STAGE", "0"))


def host_step() -> bool:
    """ZEROALLOC_HOST_STEP as set, else what the recipe gives (on under fast, else off):
    whether the windowed step steps AdamW windows whose states and parameters are all on the
    host there, on the CPUs (Note [Stepped on the host] in lib/tier/host_step.hpp)."""
    return _recipe.host_step(setting_if_set("ZEROALLOC_HOST_STEP"), recipe())


def host_step_overlap() -> bool:
    """ZEROALLOC_HOST_STEP_OVERLAP (default 1) under ZEROALLOC_ACCESS=hinted: whether the
    CPUs finish the host step's windows of master weights while the next forward runs (Note
    [The host step finishes behind the forward] in _host_step.py). Never under
    ZEROALLOC_ACCESS=any: a kernel the hints do not announce (an EMA of the weights right
    after optimizer.step()) would read weights the step has not written yet."""
    return not any_access() and enabled("ZEROALLOC_HOST_STEP_OVERLAP", "1")


def host_step_guarded() -> bool:
    """ZEROALLOC_HOST_STEP_GUARDED (default 0) under ZEROALLOC_ACCESS=any: whether the CPUs
    may finish behind the next forward where the step shows every read goes through the
    parameter object (Note [Behind the forward, guarded] in _host_step.py)."""
    return (any_access() and enabled("ZEROALLOC_HOST_STEP_GUARDED", "0")
            and enabled("ZEROALLOC_HOST_STEP_OVERLAP", "1"))


def require_offload_engine() -> None:
    if offload_setting() != "host":
        raise ZeroallocError(
            "zeroalloc.torch.offload() needs the offload engine: set ZEROALLOC_OFFLOAD=host "
            "in the environment before the process starts (and zeroalloc as PyTorch's "
            "allocator: zeroalloc.torch.install() or ZEROALLOC_TORCH=zeroalloc)")


def backward_uses_saved_only() -> bool:
    """ZEROALLOC_BACKWARD_USES (default saved): whether the backward's uses cover only the
    parameters a forward saved (Note [The backward reads what autograd saved] in
    _backward_uses.py)."""
    return setting("ZEROALLOC_BACKWARD_USES", "saved") == "saved"


def disk_tier() -> bool:
    """Whether ZEROALLOC_NVME_PATH configures the NVMe tier: any state the engine manages
    may then go to disk whenever pressure sends it (Note [Chunks on disk] in
    lib/tier/migrator.cpp)."""
    return setting("ZEROALLOC_NVME_PATH", "") != ""


def parameters_on_disk() -> bool:
    """ZEROALLOC_NVME_PARAMETERS with the NVMe tier: parameters may go to disk too."""
    return disk_tier() and enabled("ZEROALLOC_NVME_PARAMETERS", "0")
