"""Note [Behind the forward, guarded] (zeroalloc/torch/_host_step.py): a working copy of a run
still on the CPUs is a GuardedParameter. Every PyTorch call that takes it, on any thread,
waits for its window first; calls that read no bytes do not. What it computes is what a plain
parameter computes, and what it makes is plain. The step guards a run only where every read
goes through the parameter itself."""

import copy
import io
import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bindings" / "python"))
from zeroalloc.torch import _host_step  # noqa: E402
from zeroalloc.torch._host_step import guard_proof, guarded, guarded_class  # noqa: E402

GuardedParameter = guarded_class()


class Owner:
    """A HostStep's guard_wait, recorded."""

    def __init__(self):
        self.waits = []

    def guard_wait(self, behind, tensor):
        self.waits.append((behind, id(tensor), threading.current_thread().name))


@pytest.fixture
def guarded_pair():
    """A guarded parameter, an equal plain one, and the record of the guard's waits."""
    torch.manual_seed(0)
    plain = torch.nn.Parameter(torch.randn(4, 3))
    kept = torch.nn.Parameter(plain.detach().clone())
    owner, behind = Owner(), object()
    kept.__class__ = GuardedParameter
    guarded[id(kept)] = (owner, behind)
    yield kept, plain, owner
    guarded.pop(id(kept), None)


def test_every_call_that_reads_its_bytes_waits_and_computes_what_a_parameter_does(guarded_pair):
    kept, plain, owner = guarded_pair
    x = torch.randn(2, 3)
    calls = [
        lambda p: p.norm(),
        lambda p: torch.zeros(4, 3).add_(p, alpha=0.1),  # an EMA's update
        lambda p: torch.nn.functional.linear(x, p),
        lambda p: p.detach().clone(),
        lambda p: p.data.clone(),
        lambda p: p.to(torch.float64),
        lambda p: p.sum().item(),
        lambda p: torch._foreach_mul([torch.ones(4, 3)], [p])[0],
        lambda p: repr(p),
    ]
    for number, call in enumerate(calls):
        before = len(owner.waits)
        got, expected = call(kept), call(plain)
        assert len(owner.waits) > before, number
        if torch.is_tensor(expected):
            assert type(got) is type(expected) and torch.equal(got, expected), number
        else:
            assert got == expected, number
    assert all(waited[1] == id(kept) for waited in owner.waits)


def test_calls_that_read_no_bytes_do_not_wait(guarded_pair):
    kept, _, owner = guarded_pair
    kept.grad = torch.ones(4, 3)
    facts = (kept.shape, kept.dtype, kept.device, kept.requires_grad, kept.numel(), kept.dim(),
             kept.size(0), kept.is_contiguous(), kept.grad.sum().item(), hash(kept) == id(kept),
             kept in {kept}, kept.get_device(), kept.is_leaf)
    kept.grad = None
    assert facts[:3] == ((4, 3), torch.float32, torch.device("cpu"))
    assert owner.waits == []


def test_autograd_copies_and_pickles_see_a_plain_parameter(guarded_pair):
    kept, _, owner = guarded_pair
    torch.nn.functional.linear(torch.randn(2, 3), kept).sum().backward()
    assert kept.grad is not None and kept.grad.shape == (4, 3)
    copied = copy.deepcopy(kept)  # an EMA model made from the model
    assert type(copied) is torch.nn.Parameter and torch.equal(copied, kept.detach())
    saved = io.BytesIO()
    torch.save({"w": kept}, saved)
    saved.seek(0)
    loaded = torch.load(saved)["w"]
    assert type(loaded) is torch.nn.Parameter and torch.equal(loaded, kept.detach())
    assert isinstance(kept, torch.nn.Parameter)
    assert len(owner.waits) >= 3


def test_a_call_on_another_thread_waits_too(guarded_pair):
    kept, _, owner = guarded_pair
    thread = threading.Thread(target=lambda: kept.mul(2), name="reader")
    thread.start()
    thread.join()
    assert [name for *_, name in owner.waits] == ["reader"]


def test_the_step_guards_only_where_every_read_goes_through_the_parameter():
    workings = [torch.nn.Parameter(torch.randn(8)) for _ in range(3)]
    assert guard_proof(workings)
    held = workings[1].data  # a tensor over the same bytes, which no guard would see
    assert not guard_proof(workings)
    del held
    assert guard_proof(workings)
    view = workings[2].detach()[2:]
    assert not guard_proof(workings)
    del view
    assert guard_proof(workings)

    class Own(torch.nn.Parameter):
        pass

    assert not guard_proof(workings + [Own(torch.randn(2))])
    dynamo = pytest.importorskip("torch._dynamo")
    counters = dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    counters["stats"]["unique_graphs"] = before + 1  # something was compiled
    try:
        assert not guard_proof(workings)
    finally:
        counters["stats"]["unique_graphs"] = before
    assert guard_proof(workings)


def test_guard_and_unguard_swap_the_class_and_the_register():
    workings = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]

    class Behind:
        def __init__(self):
            self.workings = workings
            self.stepper = type("Stepper", (), {"host": Owner()})()
            self.guarded = False

    behind = Behind()
    _host_step.guard(behind)
    assert behind.guarded and all(type(w) is GuardedParameter for w in workings)
    assert all(guarded[id(w)][1] is behind for w in workings)
    _host_step.unguard(behind)
    assert not behind.guarded and all(type(w) is torch.nn.Parameter for w in workings)
    assert not any(id(w) in guarded for w in workings)


def test_a_graph_captured_once_keeps_every_later_run_unguarded(monkeypatch):
    """A CUDA graph's replays read the weights through pointers no guard sees: once one was
    captured in the process, no run is guarded."""
    workings = [torch.nn.Parameter(torch.randn(4))]
    monkeypatch.setattr(_host_step, "captured", [False])
    assert guard_proof(workings)
    _host_step.captured[0] = True
    assert not guard_proof(workings)


def test_rebuilding_a_guarded_parameter_from_its_class_gives_a_plain_one(guarded_pair):
    kept, _, _ = guarded_pair
    rebuilt = type(kept)(torch.zeros(2))  # as libraries that move parameters do
    assert type(rebuilt) is torch.nn.Parameter and id(rebuilt) not in guarded
