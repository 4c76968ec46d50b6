"""Note [Gradients' class, decided] (zeroalloc/torch/_gradient_choice.py): when "auto"
tries the gradients' class, and when it never does; the fixed modes never change.

    python3 -m pytest tests/python/test_gradient_choice_logic.py
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bindings" / "python"))
pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
from zeroalloc.torch._gradient_choice import GradientChoice, mode_of  # noqa: E402


def run(choice, times, moved):
    """Steps ending at the cumulative `times`, with class other moved so far `moved`;
    returns `on` after each."""
    seen = []
    for now, total in zip(times, moved):
        choice.after_step(0, now=now, moved=total)
        seen.append(choice.on)
    return seen


def test_auto_never_tries_the_class_while_no_step_moves_activations():
    choice = GradientChoice("auto")
    assert run(choice, range(50), [0] * 50) == [False] * 50
    assert choice.figures()["gradient_class"] == "watching"


def test_what_moved_before_the_first_step_ended_is_not_pressure():
    """The first step evicts as its allocations come (no order learned yet), and bytes moved
    before it (a checkpoint loaded to the GPU) are not this optimizer's: neither counts."""
    choice = GradientChoice("auto")
    assert run(choice, range(1, 12), [1 << 30] * 11) == [False] * 11
    assert choice.figures()["gradient_class_pressed_at_step"] == 0
    # The second step moved some: steps 3-5 timed, on after step 5 for the trial.
    choice = GradientChoice("auto")
    assert run(choice, range(1, 8), [1 << 30] + [2 << 30] * 6) == [False] * 4 + [True] * 3
    assert choice.figures()["gradient_class_pressed_at_step"] == 2


def test_the_choice_is_made_once():
    choice = GradientChoice("auto")
    # Steps 3-5 take 1 s; the trial's (6 settles, 7-9 timed) 3 s; decided after step 9.
    times = [1, 2, 3, 4, 5, 8, 11, 14, 17, 18]
    moved = [0, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    assert run(choice, times, moved) == [False] * 4 + [True] * 4 + [False] * 2
    assert choice.figures()["gradient_class"] == "off"
    # Activations move again, steps run faster: no second trial.
    assert run(choice, range(19, 40), range(2, 23)) == [False] * 21


def test_fixed_modes_never_change_and_a_later_mode_starts_over():
    on, off = GradientChoice(True), GradientChoice(False)
    assert run(on, range(20), range(20)) == [True] * 20
    assert run(off, range(20), range(20)) == [False] * 20
    assert (on.figures()["gradient_class"], off.figures()["gradient_class"]) == ("on", "off")
    on.set_mode("auto")
    assert not on.on and on.figures()["gradient_class"] == "watching"
    assert on.figures()["gradient_class_pressed_at_step"] == 0


def test_a_later_mode_put_back_keeps_the_decision_made():
    """A second offload() that names another gradient_class and is removed again puts the
    choice back where it stood: a decision made is not made again."""
    choice = GradientChoice("auto")
    run(choice, [1, 2, 3, 4, 5, 8, 11, 14, 17], [0] + [1] * 8)
    assert choice.figures()["gradient_class"] == "off"
    earlier = choice.snapshot()
    choice.set_mode(True)
    assert choice.on
    choice.restore(earlier)
    assert not choice.on and choice.figures() == earlier.figures()
    assert run(choice, range(18, 30), range(2, 14)) == [False] * 12


def test_a_mode_that_is_not_one_is_refused():
    assert [mode_of(True), mode_of(False), mode_of("auto")] == [True, False, "auto"]
    assert [mode_of(1), mode_of(0)] == [True, False]
    for bad in ("on", 2, None, "yes", 1.0):
        with pytest.raises(ValueError, match="use True, False or 'auto'"):
            mode_of(bad)


def test_a_failed_read_of_what_moved_keeps_the_class_as_it_is(monkeypatch):
    """The step that ran succeeded: a library that cannot say what moved ends the choice
    where it stands, with a warning, and raises nothing into the training loop."""
    from zeroalloc import _stats
    from zeroalloc._library import ZeroallocError

    def fail(device, name):
        raise ZeroallocError("no such device: 7")

    monkeypatch.setattr(_stats, "moved_bytes", fail)
    choice = GradientChoice("auto")
    with pytest.warns(UserWarning, match="stays as it is .watching.*no such device: 7"):
        choice.after_step(7, now=1.0)
    assert (choice.on, choice.figures()["gradient_class"]) == (False, "off")
    choice.after_step(7, now=2.0)  # decided: no second read, no second warning
