"""Whether gradients go into their own allocation class (ZEROALLOC_OFFLOAD_GRADIENTS,
offload()'s gradient_class), decided from the steps when asked to.

Note [Gradients' class, decided]: in their own class (Note [Gradients' class] in
_adoption.py) gradients move to the host before the activations do, which lets a step fit
under a lower limit, but each costs a device-to-device copy a step and no longer reuses the
memory the backward frees from activations: measured on an H200 with the 1.3B bench model
(bench/RESULTS.md, "Gradients' class, decided"), 0.73 x the tokens per second at 13.3 GiB
with master weights, where the states alone make room, and about even with fp32 weights at
the same limit, where activations had to move. So neither setting is right everywhere.

`auto` (the default) starts with the gradients where autograd puts them and watches the
steps: after each optimizer step it reads how many bytes of class "other" the engine moved
to the host during that step (zeroalloc_moved_bytes: a cheap read). Class "other" moves
only as the last resort before an out-of-memory error (Note [Residency policy] in
lib/tier/offload_engine.hpp), so a step that moved it ran at the limit with its
activations, weights and gradients together (what moved before the first step ended does
not count: that step evicts as allocations come, before the order is learned). Once that
happened, and the last TRIAL_STEPS steps were timed (the first WARMUP_STEPS are not: they
learn the order and settle the placement), the gradients go into their class for a trial:
one step to settle, then TRIAL_STEPS timed steps. The class stays on when the median of
those is at most SLOWER times the median of the steps before, and goes off for good
otherwise; either way the choice is made once per optimizer and never flips again. The
hooks that copy gradients into the class are added only when a trial begins
(WindowedStep.hook_gradients) and taken out again when it ends with the class off, so a
backward outside a trial runs as without them. The trial's hooks act on the gradients a
backward makes: gradients kept between steps (zero_grad(set_to_none=False)) stay where they
are, and so the trial changes nothing for them. Ranks of a ZeRO partition decide each on
their own steps (their times are tied by the collectives, so they mostly agree; the numbers
trained are the same either way). A step's time is the wall time between the ends of two
optimizer steps (forward, backward and step: what a training loop waits for). The numbers
trained are the same either way: the class holds a copy of each gradient, bit for bit.
Without an optimizer (offload(model) alone) there are no steps to watch, so `auto` stays
off. zt.step_figures(optimizer) says what was chosen and the two medians."""

from __future__ import annotations

import statistics
import time
import warnings

from zeroalloc import _stats
from zeroalloc._library import ZeroallocError

#: Steps whose time is not used: the first learns the order of uses, the second settles
#: the placement (bench logs: 2.2 s, 1.0 s, then 0.43 s at 13.3 GiB of the 1.3B model).
WARMUP_STEPS = 2
#: Timed steps on each side of the trial.
TRIAL_STEPS = 3
#: The class stays on unless its steps took more than this times the steps without it
#: (a tie keeps it on: the run was at the limit, and the class leaves more room).
SLOWER = 1.02


def mode_of(value) -> "str | bool":
    """gradient_class as offload() takes it: True (or 1), False (or 0) or "auto"."""
    if isinstance(value, str):
        if value == "auto":
            return value
    elif isinstance(value, int) and value in (0, 1):  # bool is an int
        return bool(value)
    raise ValueError(f"gradient_class={value!r}: use True, False or 'auto'")


class GradientChoice:
    """Whether the gradients of one optimizer's parameters are copied into their class: the
    hooks of Note [Gradients' class] read `on`; the windowed step calls after_step."""

    __slots__ = ("mode", "on", "state", "ended", "moved", "steps", "off_s", "on_s",
                 "settling", "pressed_at")

    def __init__(self, mode="auto"):
        self.set_mode(mode)

    def set_mode(self, mode) -> None:
        """A mode (a later offload() that names gradient_class): True or False hold from the
        next backward on; "auto" watches the steps from the next one, as at the start."""
        self.mode = mode_of(mode)
        self.on = self.mode is True
        self.state = "watching" if self.mode == "auto" else ("on" if self.on else "off")
        self.ended = None  # time.perf_counter() at the last step's end
        self.moved = None  # bytes of class other moved to the host by then
        self.steps = 0
        self.off_s: list = []
        self.on_s: list = []
        self.settling = 0
        self.pressed_at = 0  # the step that moved class other first (watching), or 0

    def after_step(self, device: int, now: "float | None" = None,
                   moved: "int | None" = None) -> None:
        """The optimizer's step ended (on `device`): the next step of the decision.
        `now` and `moved` (bytes of class other moved to the host so far) are read when not
        given."""
        if self.state not in ("watching", "trial"):
            return
        now = time.perf_counter() if now is None else now
        if moved is None:
            try:
                moved = _stats.moved_bytes(device, "other")[0]
            except ZeroallocError as error:  # the step itself succeeded: it stays so
                warnings.warn(f"zeroalloc: the gradients' class stays as it is ({self.state}), "
                              f"since what moved could not be read: {error}")
                self.state = "on" if self.on else "off"
                return
        seconds = now - self.ended if self.ended is not None else None
        # What moved before the first step ended is not counted: the step that learns the
        # order evicts as allocations come, and a checkpoint loaded earlier moved alone.
        pressed = self.moved is not None and moved > self.moved
        self.ended, self.moved = now, moved
        self.steps += 1
        timed = seconds is not None and self.steps > WARMUP_STEPS
        if self.state == "watching":
            if timed:
                self.off_s = (self.off_s + [seconds])[-TRIAL_STEPS:]
            if pressed and not self.pressed_at:
                self.pressed_at = self.steps
            if self.pressed_at and len(self.off_s) == TRIAL_STEPS:
                self.state, self.on, self.settling = "trial", True, 1
            return
        if self.settling:  # the first step in the class: it grows while the copies are made
            self.settling -= 1
            return
        self.on_s.append(seconds)
        if len(self.on_s) == TRIAL_STEPS:
            self.on = statistics.median(self.on_s) <= SLOWER * statistics.median(self.off_s)
            self.state = "on" if self.on else "off"

    def give_up(self) -> None:
        """Off for good (a trial that could not begin)."""
        self.state, self.on = "off", False

    def snapshot(self) -> "GradientChoice":
        """A copy of where the choice stands, for restore()."""
        copy = GradientChoice.__new__(GradientChoice)
        copy.restore(self)
        return copy

    def restore(self, snapshot: "GradientChoice") -> None:
        """Where the choice stood at snapshot(): a decision made is not made again."""
        for name in self.__slots__:
            value = getattr(snapshot, name)
            setattr(self, name, list(value) if isinstance(value, list) else value)

    def figures(self) -> dict:
        """What zt.step_figures reports: the mode, where the choice stands (watching, trial,
        on, off), the step that first moved class other, and the medians compared."""
        median = lambda times: statistics.median(times) if times else 0.0  # noqa: E731
        return {"gradient_class_mode": str(self.mode).lower(),
                "gradient_class": self.state,
                "gradient_class_pressed_at_step": self.pressed_at,
                "gradient_class_off_s": median(self.off_s),
                "gradient_class_on_s": median(self.on_s)}
