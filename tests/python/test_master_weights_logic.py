"""Master weights (Note [Master weights] in zeroalloc/torch/_master_weights.py) on CPU
tensors, with the engine replaced by the stand-ins of test_windowed_step_logic: the windowed
step of fp32 masters for a bf16 model gives, bit for bit, what the same recipe computes in
plain PyTorch (with gradient accumulation and states staged and kept), zero_grad clears the
working gradients, the optimizer's state dict carries the masters and loading it brings
them back, a model's load_state_dict sets the masters, and remove() gives fp32 parameters
back; what must wait for windows still on the CPUs after a step (Note [The host step
finishes behind the forward]) asks for them. The host's windows are tested on the GPU
(test_host_step.py).

    python3 -m pytest tests/python/test_master_weights_logic.py
"""

import copy
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bindings" / "python"))
import zeroalloc.torch as zt  # noqa: E402
from zeroalloc._library import ZeroallocError  # noqa: E402
from zeroalloc.torch import _master_weights  # noqa: E402
from test_windowed_step_logic import LAYER_BYTES, build, data, engine  # noqa: E402,F401

BF16 = torch.bfloat16


def managed(overlap_bytes=9 * LAYER_BYTES):
    """What zt.offload(model, optimizer, master_weights=True) installs, without the library."""
    model, optimizer = build()
    masters = _master_weights.MasterWeights(BF16)
    masters.make(optimizer)
    masters.install(optimizer)
    optimizer._zeroalloc_masters = masters
    masters.install_model_hook(model)
    for parameter in model.parameters():
        parameter._zeroalloc_adopted = True
        parameter.register_post_accumulate_grad_hook(zt._end_backward)
    zt._install_hint_hooks(model, LAYER_BYTES + 1024)
    optimizer.step = zt._windowed_step(optimizer, optimizer.step, 6 * LAYER_BYTES + 1,
                                       overlap_bytes)
    zt._readopt_after_load(optimizer)
    return model, optimizer


class Reference:
    """The recipe in plain PyTorch: a bf16 model, fp32 masters stepped by AdamW from the
    gradients cast to fp32, rounded back into the model after each step."""

    def __init__(self):
        self.model, _ = build()
        self.masters = [p.detach().clone() for p in self.model.parameters()]
        self.model.to(BF16)
        self.optimizer = torch.optim.AdamW(self.masters, lr=1e-2, foreach=True)

    def step(self):
        for master, working in zip(self.masters, self.model.parameters()):
            master.grad = working.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for master, working in zip(self.masters, self.model.parameters()):
                working.copy_(master)
                master.grad = None
        self.model.zero_grad(set_to_none=True)


def backward(model, inputs, labels, micro):
    for m in range(micro):
        logits = model(inputs[m].to(BF16)).float()
        (torch.nn.functional.cross_entropy(logits, labels[m]) / micro).backward()


def train(model, optimizer, steps):
    for inputs, labels in data(steps):
        backward(model, inputs, labels, 1)
        optimizer.step()
        optimizer.zero_grad()


def same(reference, model, optimizer):
    masters = optimizer._zeroalloc_masters
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for ref_master, ref_working, master, working in zip(
            reference.masters, reference.model.parameters(), params, model.parameters()):
        assert working.dtype == BF16 and master.dtype == torch.float32
        assert masters.working(master) is working
        assert torch.equal(ref_working, working)
        assert torch.equal(ref_master, master)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(reference.optimizer.state[ref_master][key],
                               optimizer.state[master][key]), key


def test_masters_train_bit_for_bit_as_the_recipe_in_plain_pytorch(engine, monkeypatch):
    reference = Reference()
    model, optimizer = managed()
    # Every use a step begins (the working copies written after each window) ends in it.
    open_at_boundaries = []
    boundary = engine.step_boundary

    def step_boundary():
        open_at_boundaries.append(sum(engine.uses.values()))
        boundary()

    monkeypatch.setattr(zt._offload, "step_boundary", step_boundary)
    begun = set()
    begins = engine.use_begins_many

    def use_begins_many(pointers, stream=0):
        begun.update(pointers)
        begins(pointers, stream)

    monkeypatch.setattr(zt._offload, "use_begins_many", use_begins_many)
    working_pointers = {p.untyped_storage().data_ptr() for p in model.parameters()}
    stepper = optimizer._zeroalloc_stepper
    # The working copies' accumulations count for the staging of the masters' step.
    assert {id(p) for p in model.parameters()} <= stepper.members
    for number, (inputs, labels) in enumerate(data(8)):
        micro = 2 if 3 <= number < 5 else 1
        backward(reference.model, inputs, labels, micro)
        reference.step()
        backward(model, inputs, labels, micro)
        optimizer.step()
        assert all(p.grad is not None for p in model.parameters())  # the step keeps them
        optimizer.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())
        masters = [p for group in optimizer.param_groups for p in group["params"]]
        assert all(m.grad is None for m in masters)
        same(reference, model, optimizer)
    figures = zt.step_figures(optimizer)
    assert figures["staged_windows"] > 0 and figures["kept_windows"] > 0, figures
    assert engine.stray_ends == []
    assert open_at_boundaries == [0] * 8
    # The step's uses reached the working copies (the engine fetches them to be written).
    assert working_pointers <= begun


def test_zero_grad_without_set_to_none_zeroes_the_working_gradients(engine):
    model, optimizer = managed()
    inputs, labels = data(1)[0]
    backward(model, inputs, labels, 1)
    optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_the_state_dict_carries_the_masters_and_loading_it_brings_them_back(engine):
    model, optimizer = managed()
    train(model, optimizer, 3)
    saved = copy.deepcopy(optimizer.state_dict())
    masters = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
    assert len(saved["zeroalloc_master_weights"]) == len(masters)
    assert all(torch.equal(a, b) for a, b in zip(saved["zeroalloc_master_weights"], masters))
    # The masters carry bits the bf16 working copies do not.
    assert any(not torch.equal(m, w.float()) for m, w in zip(masters, model.parameters()))
    fresh, fresh_optimizer = managed()
    fresh.load_state_dict(model.state_dict())  # bf16 values: the masters take them, rounded
    fresh_masters = [p for g in fresh_optimizer.param_groups for p in g["params"]]
    assert all(torch.equal(m, w.float()) for m, w in zip(fresh_masters, fresh.parameters()))
    fresh_optimizer.load_state_dict(saved)  # and the optimizer's brings the fp32 values
    assert all(torch.equal(a, b) for a, b in zip(fresh_masters, masters))
    assert all(torch.equal(w, m.to(BF16)) for w, m in zip(fresh.parameters(), masters))
    # Both go on training alike.
    for inputs, labels in data(2):
        for each, its_optimizer in ((model, optimizer), (fresh, fresh_optimizer)):
            backward(each, inputs, labels, 1)
            its_optimizer.step()
            its_optimizer.zero_grad()
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    wrong = dict(saved, zeroalloc_master_weights=saved["zeroalloc_master_weights"][:-1])
    with pytest.raises(ZeroallocError, match="cover .* parameters, the optimizer has"):
        fresh_optimizer.load_state_dict(wrong)


def test_remove_gives_fp32_parameters_with_the_masters_values_back(engine, monkeypatch):
    model, optimizer = managed()
    for inputs, labels in data(2):
        backward(model, inputs, labels, 1)
        optimizer.step()
    masters = [p.detach().clone() for g in optimizer.param_groups for p in g["params"]]
    states = [optimizer.state[p]["exp_avg"].clone() for g in optimizer.param_groups
              for p in g["params"]]
    handle = zt.OffloadHandle([], optimizer, None)
    handle.remove()
    params = list(model.parameters())
    assert [p for g in optimizer.param_groups for p in g["params"]] == params
    for parameter, master, state in zip(params, masters, states):
        assert parameter.dtype == torch.float32 and torch.equal(parameter, master)
        assert parameter.grad.dtype == torch.float32
        assert torch.equal(optimizer.state[parameter]["exp_avg"], state)
    assert "zero_grad" not in optimizer.__dict__
    optimizer.step()  # plain AdamW again, over fp32 parameters


def test_master_weights_are_made_only_before_zeroalloc_manages_the_parameters():
    model, optimizer = build()
    next(model.parameters())._zeroalloc_adopted = True
    with pytest.raises(ZeroallocError, match="first offload"):
        _master_weights.MasterWeights(BF16).make(optimizer)


def test_master_weights_choices_and_their_errors(monkeypatch):
    assert _master_weights.working_dtype(True) is BF16
    assert _master_weights.working_dtype("bf16") is BF16
    assert _master_weights.working_dtype(torch.bfloat16) is BF16
    assert _master_weights.working_dtype(False) is None
    with pytest.raises(ZeroallocError, match="master_weights='fp8'"):
        _master_weights.working_dtype("fp8")
    monkeypatch.delenv("ZEROALLOC_MASTER_WEIGHTS", raising=False)
    monkeypatch.delenv("ZEROALLOC_RECIPE", raising=False)
    assert _master_weights.working_dtype(None) is None
    monkeypatch.setenv("ZEROALLOC_RECIPE", "fast")  # the recipe's, when the variable is unset
    assert _master_weights.working_dtype(None) is BF16
    monkeypatch.setenv("ZEROALLOC_MASTER_WEIGHTS", "none")
    assert _master_weights.working_dtype(None) is None
    monkeypatch.setenv("ZEROALLOC_RECIPE", "exact")
    monkeypatch.setenv("ZEROALLOC_MASTER_WEIGHTS", "bf16")
    assert _master_weights.working_dtype(None) is BF16


AUTOMATIC = r"""
import torch
import zeroalloc.torch as zt
zt.enable_automatic_offload()  # what the start-up hook does with ZEROALLOC_OFFLOAD=host


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


model = build()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # made as the script makes it
print("dtypes", sorted({str(p.dtype) for p in model.parameters()}))
reference = build()
masters = [p.detach().clone() for p in reference.parameters()]
reference.to(torch.bfloat16)
plain = torch.optim.AdamW.__new__(torch.optim.AdamW)
plain._zeroalloc_adopted = True  # the reference's optimizer stays plain
plain.__init__(masters, lr=1e-2)
torch.manual_seed(1)
for _ in range(4):
    x, y = torch.randn(8, 16).to(torch.bfloat16), torch.randint(0, 4, (8,))
    for each in (model, reference):
        torch.nn.functional.cross_entropy(each(x).float(), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    for master, working in zip(masters, reference.parameters()):
        master.grad = working.grad.float()
    plain.step()
    with torch.no_grad():
        for master, working in zip(masters, reference.parameters()):
            working.copy_(master)
            master.grad = None
    reference.zero_grad()
    assert all(p.grad is None for p in model.parameters())
same = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
kept = [p for g in optimizer.param_groups for p in g["params"]]
print("same", same, "masters", all(torch.equal(a, b) for a, b in zip(kept, masters)))
"""


def test_the_automatic_mode_makes_master_weights_from_the_environment(tmp_path):
    """ZEROALLOC_MASTER_WEIGHTS=bf16 with the no-code-change mode: every optimizer made
    afterwards steps fp32 masters of its parameters, now bf16, as the recipe does."""
    import os
    import subprocess
    env = {key: value for key, value in os.environ.items() if not key.startswith("ZEROALLOC_")}
    env.update({"ZEROALLOC_DEVICE": "sim", "ZEROALLOC_OFFLOAD": "host",
                "ZEROALLOC_MASTER_WEIGHTS": "bf16",
                "ZEROALLOC_LIBRARY": os.environ.get(
                    "ZEROALLOC_LIBRARY",
                    str(Path(__file__).resolve().parents[2] / "build" / "libzeroalloc.so")),
                "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "bindings" / "python")})
    result = subprocess.run([sys.executable, "-c", AUTOMATIC], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "dtypes ['torch.bfloat16']" in result.stdout, result.stdout
    assert "same True masters True" in result.stdout, result.stdout


def test_a_partial_or_submodule_load_sets_only_the_masters_it_changed(engine):
    model, optimizer = managed()
    train(model, optimizer, 2)
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    before = [m.clone() for m in masters]
    layer = model[3][0]  # a Linear inside the model
    new_weight = torch.full_like(layer.weight, 0.5)
    layer.load_state_dict({"weight": new_weight}, strict=False)  # its bias not loaded
    working = list(model.parameters())
    for master, old, each in zip(masters, before, working):
        if each is layer.weight:
            assert torch.equal(master, new_weight.float())  # the load reached the master
        else:  # untouched, fp32 bits kept (not rounded to the working copy's bf16)
            assert torch.equal(master, old)
    assert any(not torch.equal(m, w.float()) for m, w in zip(masters, working))


def test_an_optimizer_made_again_over_working_copies_gets_masters_with_their_values(engine):
    model, optimizer = managed()
    train(model, optimizer, 2)
    first = [p for g in optimizer.param_groups for p in g["params"]]
    again = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    masters = _master_weights.MasterWeights(BF16)
    masters.make(again)
    second = [p for g in again.param_groups for p in g["params"]]
    assert all(b.dtype == torch.float32 and b is not a and torch.equal(a, b)
               for a, b in zip(first, second))
    assert all(masters.working(m) is w for m, w in zip(second, model.parameters()))


def test_master_weights_refuse_optimizers_that_do_not_step_their_param_groups():
    model, _ = build()
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ZeroallocError, match="LBFGS"):
        _master_weights.MasterWeights(BF16).make(lbfgs)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing changed


def test_zero_stages_refuse_an_optimizer_with_master_weights(engine):
    _, optimizer = managed()
    with pytest.raises(ZeroallocError, match="do not combine with master weights"):
        zt.partition(optimizer, stage=2)


class Pending:
    """A host step with windows still on the CPUs (Note [The host step finishes behind the
    forward] in zeroalloc/torch/_host_step.py), as the waits see it."""

    def __init__(self, monkeypatch):
        from zeroalloc.torch import _host_step, _use_hints
        self.finished = 0
        self.used: list = []
        self.steps, self.hooks = [], []
        monkeypatch.setattr(_host_step, "behind_steps", self.steps)
        monkeypatch.setattr(_use_hints, "before_use", self.hooks)
        self.again()

    def again(self):
        self.steps.append(self)
        self.hooks.append(self.before_use)

    def before_use(self, tensors, stream):
        self.used.extend(id(t) for t in tensors)

    def finish_behind(self):
        self.finished += 1
        self.steps.remove(self)
        self.hooks.remove(self.before_use)


def test_what_reads_or_writes_working_copies_or_masters_waits_for_the_cpus(
        engine, monkeypatch):
    """Between a step that left windows on the CPUs and the next forward: the forward's
    hinted uses of the working copies ask first; the model's and the optimizer's state
    dicts, their loads and zero_grad(set_to_none=False) wait for every window."""
    from zeroalloc.torch import _state_dict
    model, optimizer = managed()
    _state_dict.pin_during_load(model)  # as zt.offload installs it
    train(model, optimizer, 2)
    saved_model, saved_optimizer = model.state_dict(), optimizer.state_dict()
    pending = Pending(monkeypatch)
    inputs, _ = data(1)[0]
    model(inputs[0].to(BF16))  # a forward: each module's use of its working copies asks
    assert {id(p) for p in model.parameters()} <= set(pending.used)
    optimizer.zero_grad(set_to_none=True)  # the gradients' copies are queued: no wait
    assert pending.finished == 0
    for number, action in enumerate((
            lambda: model.state_dict(),
            lambda: optimizer.state_dict(),
            lambda: model.load_state_dict(saved_model),
            lambda: optimizer.load_state_dict(saved_optimizer),
            lambda: optimizer.zero_grad(set_to_none=False))):
        if number:
            pending.again()
        action()
        assert pending.finished == number + 1, number
