"""Note [The CPUs' windows] (zeroalloc/torch/_host_step.py): the CPUs can step the step's
host windows merged, in their order, up to a number of parameters each, so that a step
spends fewer of its milliseconds per window on its own bookkeeping. On by default, at 512 M
parameters a window."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bindings" / "python"))
from zeroalloc.torch._host_step import HostStep  # noqa: E402


def sizes(turns):
    return [(number, [p.numel() for p in hosted]) for number, hosted in turns]


def test_consecutive_host_windows_merge_up_to_the_cap_in_their_order():
    host = HostStep()
    host.window_parameters = 100
    tensors = [torch.empty(n) for n in (40, 30, 20, 50, 60, 10)]
    chosen = [(0, tensors[0:2]), (1, tensors[2:3]), (2, tensors[3:4]), (3, tensors[4:6])]
    turns = host.merged(chosen)
    # 40+30 and 20 fit in 100; 50 does not fit beside them; 60+10 does not fit beside 50.
    assert sizes(turns) == [(0, [40, 30, 20]), (2, [50]), (3, [60, 10])]
    stepped = [p for _, hosted in turns for p in hosted]
    assert [id(p) for p in stepped] == [id(p) for p in tensors]  # each once, in order


def test_windows_the_device_steps_between_are_not_jumped_over():
    """Window 1 steps on the device: the CPUs' windows 0 and 2 stay apart, so a forward
    behind the CPUs does not wait at window 0 for window 2."""
    host = HostStep()
    host.window_parameters = 100
    small = torch.empty(5)
    assert sizes(host.merged([(0, [small]), (2, [small]), (3, [small])])) == [
        (0, [5]), (2, [5, 5])]


def test_a_window_larger_than_the_cap_is_stepped_alone_and_one_means_no_merge():
    host = HostStep()
    host.window_parameters = 100
    big, small = torch.empty(500), torch.empty(5)
    assert sizes(host.merged([(0, [small]), (1, [big]), (2, [small])])) == [
        (0, [5]), (1, [500]), (2, [5])]
    host.window_parameters = 1
    chosen = [(0, [small]), (1, [small])]
    assert sizes(host.merged(chosen)) == [(0, [5]), (1, [5])]
    assert host.merged([]) == []


def test_by_default_windows_merge_up_to_512_m_parameters_and_zero_turns_it_off():
    host = HostStep()
    assert host.window_parameters == 512 << 20
    small = [torch.empty(5) for _ in range(3)]
    assert sizes(host.merged([(0, small[:1]), (1, small[1:2]), (2, small[2:])])) == [
        (0, [5, 5, 5])]
    host.window_parameters = 0
    assert sizes(host.merged([(0, small[:1]), (1, small[1:2])])) == [(0, [5]), (1, [5])]


class Stepper:
    """What HostStep.plan reads of the windowed step: the optimizer, and no masters."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.masters = None


def test_a_windows_calls_are_one_per_group_and_step_count_with_their_addresses():
    """Note [Windows prepared ahead]: the plan the CPUs' thread calls with, made before it
    starts or by it, is the same: one call per group and step count, in the window's
    order, each pointing at the parameters', gradients' and states' memory."""
    from zeroalloc.torch._host_step import adamw_settings
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3, 4, 5, 6)]
    optimizer = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:]}])
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()  # the states exist, each at step 1
    optimizer.state[params[2]]["step"] += 1  # one parameter a step ahead (added later, say)
    groups = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    settings = {id(g): adamw_settings(optimizer, g) for g in optimizer.param_groups}
    views = [torch.zeros(p.numel()) for p in params]
    calls = HostStep().plan(Stepper(optimizer), params, views, groups, settings, 0)
    assert [(c.count, [p.numel() for p, _ in c.members]) for c in calls] == [
        (2, [3, 4]), (3, [5]), (2, [6])]
    first = calls[0]
    states = [optimizer.state[p] for p in params[:2]]
    assert first.arguments == ([p.untyped_storage().data_ptr() for p in params[:2]],
                               [v.data_ptr() for v in views[:2]],
                               [s["exp_avg"].untyped_storage().data_ptr() for s in states],
                               [s["exp_avg_sq"].untyped_storage().data_ptr() for s in states])
    assert first.counts == [3, 4] and first.outputs is None and not first.master
    assert first.settings == settings[id(optimizer.param_groups[0])]


def test_step_counts_rise_by_one_batched_or_not():
    from zeroalloc.torch._host_step import count_steps
    for batched in (False, True):
        states = [{"step": torch.tensor(4.0)}, {"step": 7}, {"step": torch.tensor(1.0)}]
        count_steps(states, batched)
        assert [float(s["step"]) for s in states] == [5.0, 8.0, 2.0]


def test_gradients_queue_ahead_for_masters_within_an_eighth_of_the_host():
    """Note [Gradients queued ahead]: only runs of masters queue ahead, and only while their
    bf16 gradients fit in the budget (an eighth of the host's memory); the rest queue
    window by window."""

    class Masters:
        def __init__(self, masters):
            self.ids = {id(m) for m in masters}

        def working(self, parameter):
            return parameter if id(parameter) in self.ids else None

    tensors = [torch.empty(n) for n in (30, 20, 50)]
    stepper = Stepper(None)
    stepper.masters = Masters(tensors)
    host = HostStep()
    assert host.queue_ahead and host.ahead_bytes > 0  # on by default, within its budget
    host.ahead_bytes = 200  # 100 parameters: 200 bytes of bf16 gradients
    chosen = [(0, tensors[:2]), (1, tensors[2:])]
    assert host.queues_ahead(stepper, chosen)
    host.ahead_bytes = 199
    assert not host.queues_ahead(stepper, chosen)
    host.ahead_bytes = 200
    stepper.masters = Masters(tensors[:2])  # one not a master: its gradient is fp32
    assert not host.queues_ahead(stepper, chosen)
    stepper.masters = Masters(tensors)
    host.queue_ahead = False
    assert not host.queues_ahead(stepper, chosen)
