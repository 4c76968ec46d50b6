"""The windowed step's bookkeeping (Note [Overlapping the step] in
zeroalloc/torch/_optimizer_step.py) on CPU tensors, with CUDA streams and events and the
engine replaced by stand-ins: training through it with states staged during backward and
kept after the step gives plain training's numbers bit for bit, with gradient accumulation,
state_dict and load_state_dict between a step and the next forward, and a backward with no
step after it; every pin it takes ends, once, and nothing stays pinned or registered when it
settles. The stream ordering itself is tested on the GPU (test_windowed_step.py).

    python3 -m pytest tests/python/test_windowed_step_logic.py
"""

import contextlib
import copy
import sys
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bindings" / "python"))
import zeroalloc.torch as zt  # noqa: E402
from zeroalloc import _stats  # noqa: E402
from zeroalloc.torch import (  # noqa: E402
    _adoption, _gradient_choice, _module_hints, _optimizer_step, _settings, _use_hints)
from zeroalloc.torch._gradient_choice import GradientChoice  # noqa: E402


class FakeStream:
    cuda_stream = 1

    def __init__(self, device=None):
        self.device = torch.device("cpu") if device is None else device

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass


class FakeEvent:
    def record(self, stream=None):
        pass

    def query(self):
        return True


class Engine:
    """Stands in for the engine: pins (use_in_place) and uses (use_begins) per storage, each
    closed by a use_ends, and all closed at a step boundary as the engine closes them; an
    end with nothing open (a pin ended twice) is recorded in `stray_ends`."""

    def __init__(self):
        self.pins = Counter()
        self.uses = Counter()
        self.stray_ends = []
        self.in_place = 0
        self.boundaries = 0
        self.pinned_ever = set()

    def use_in_place_many(self, pointers, stream=0):
        self.in_place += len(pointers)
        self.pins.update(pointers)
        self.pinned_ever.update(pointers)

    def use_ends_many(self, pointers, stream=0):
        for pointer in pointers:
            if self.pins[pointer] > 0:
                self.pins[pointer] -= 1
            elif self.uses[pointer] > 0:
                self.uses[pointer] -= 1
            else:
                self.stray_ends.append(pointer)

    def use_begins_many(self, pointers, stream=0):
        self.uses.update(pointers)

    def step_boundary(self):
        self.pins.clear()
        self.uses.clear()
        self.boundaries += 1

    def residency_of(self, pointer):
        return "host"  # every state is bounced through scratch

    def open(self):
        return sum(count for count in self.pins.values() if count > 0)


@pytest.fixture
def engine(monkeypatch):
    fake = Engine()
    main = FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    for name in ("use_in_place_many", "use_ends_many", "use_begins_many", "step_boundary",
                 "residency_of"):
        monkeypatch.setattr(zt._offload, name, getattr(fake, name))
    monkeypatch.setattr(_adoption, "is_paged_state",
                        lambda v: torch.is_tensor(v) and v.dim() > 0 and v.numel() > 0)
    monkeypatch.setattr(_use_hints, "current_stream", lambda device_index=None: 1)
    # CPU tensors stand for GPU ones.
    monkeypatch.setattr(_optimizer_step, "on_gpu", lambda device: True)
    monkeypatch.setattr(_stats, "allocation_class", lambda name: contextlib.nullcontext())
    monkeypatch.setattr(_stats, "raw_stats", lambda device=0: {"limit_bytes": 1 << 40})
    monkeypatch.setattr(_stats, "room", lambda device, name: (1 << 40, 1 << 40))
    monkeypatch.setattr(_adoption, "move_into_class", lambda tensor, name: tensor.clone())
    yield fake
    zt._windowed_steps.overlapping.clear()
    zt._windowed_steps.kept_states.clear()
    zt._windowed_steps.writing_back.clear()


WIDTH, LAYERS = 32, 8
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH),
                                                      torch.nn.Tanh())
                                  for _ in range(LAYERS)], torch.nn.Linear(WIDTH, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)


def managed(overlap_bytes, group_bytes=LAYER_BYTES + 1024, gradient_class=False):
    """What zt.offload installs, without the library: hint hooks (groups of at most
    `group_bytes`), gradient hooks (`gradient_class`: True, False or "auto"), the windowed
    step and the state-dict wrappers."""
    model, optimizer = build()
    choice = GradientChoice(gradient_class)
    for parameter in model.parameters():
        parameter._zeroalloc_adopted = parameter._zeroalloc_hooked = True
        parameter.register_post_accumulate_grad_hook(zt._end_backward)
        if choice.on:  # "auto": the step hooks them when it tries the class
            parameter.register_hook(zt._gradient_into_class(parameter, choice))
    zt._install_hint_hooks(model, group_bytes)
    optimizer.step = zt._windowed_step(optimizer, optimizer.step, 6 * LAYER_BYTES + 1,
                                       overlap_bytes, gradients=choice)
    zt._readopt_after_load(optimizer)
    return model, optimizer


def train(model, optimizer, inputs, labels, micro=1):
    for m in range(micro):
        loss = torch.nn.functional.cross_entropy(model(inputs[m]), labels[m]) / micro
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def same(plain, plain_optimizer, model, optimizer):
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(plain_optimizer.state[a][key], optimizer.state[b][key]), key


def data(steps):
    torch.manual_seed(1)
    return [(torch.randn(2, 16, WIDTH), torch.randint(0, 4, (2, 16))) for _ in range(steps)]


def test_overlapped_training_equals_plain_training_and_every_pin_ends(engine):
    plain, plain_optimizer = build()
    model, optimizer = managed(overlap_bytes=9 * LAYER_BYTES)
    stepper = optimizer._zeroalloc_stepper
    homes = {}
    for number, (inputs, labels) in enumerate(data(10)):
        micro = 2 if 3 <= number < 5 else 1
        train(plain, plain_optimizer, inputs, labels, micro)
        train(model, optimizer, inputs, labels, micro)
        if number == 0:
            homes = {id(v) for s in optimizer.state.values() for v in s.values()}
        if number >= 2:
            assert stepper.kept, "the last windows' states were not kept after the step"
            kept = [e.state[e.key] for e in stepper.kept]
            assert all(id(t) not in homes for t in kept)  # scratch in the state dict
            assert zt._windowed_steps.kept_states
        if number == 6:  # state_dict writes the kept states back: their own tensors
            saved = optimizer.state_dict()
            assert {id(v) for s in saved["state"].values() for v in s.values()
                    if torch.is_tensor(v) and v.dim() > 0} <= homes
            assert not stepper.kept and not zt._windowed_steps.kept_states
        if number == 7:
            optimizer.load_state_dict(copy.deepcopy(plain_optimizer.state_dict()))
            homes = {id(v) for s in optimizer.state.values() for v in s.values()}
        same(plain, plain_optimizer, model, optimizer)
    figures = zt.step_figures(optimizer)
    assert figures["staged_windows"] >= 2 * 7 and figures["kept_windows"] >= 2 * 7, figures
    # What is pinned now: the kept states' own tensors; a forward writes them back.
    assert engine.open() == sum(1 for e in stepper.kept if e.pinned)
    with torch.no_grad():
        model(data(1)[0][0][0])
        model(data(1)[0][0][0])  # the write-back's event is done: own tensors back
    assert engine.open() == 0 and not stepper.kept and not zt._windowed_steps.kept_states
    # A backward with no step after it stages; the next forward unpins what it staged.
    inputs, labels = data(1)[0]
    torch.nn.functional.cross_entropy(model(inputs[0]), labels[0]).backward()
    assert any(stepper.staged) and engine.open() > 0
    with torch.no_grad():
        model(inputs[0])
    assert engine.open() == 0 and not stepper.staged
    assert engine.stray_ends == []  # no pin or use ended twice


@pytest.mark.parametrize("place", ["host", "device"])
def test_parameters_are_stepped_where_they_are_never_fetched_for_the_step(engine, monkeypatch,
                                                                         place):
    """Note [Parameters stepped where they are]: the step pins every parameter where it is
    and hints no use of it (a use would fetch it); one on the host is copied through scratch
    and back, and training gives plain training's numbers bit for bit."""
    plain, plain_optimizer = build()
    model, optimizer = managed(overlap_bytes=0)
    homes = {p.untyped_storage().data_ptr() for p in model.parameters()}
    monkeypatch.setattr(zt._offload, "residency_of",
                        lambda pointer: place if pointer in homes else "host")
    stepping, begun, pinned = [False], [], []
    for name, seen in (("use_begins_many", begun), ("use_in_place_many", pinned)):
        def recording(pointers, stream=0, call=getattr(engine, name), seen=seen):
            if stepping[0]:
                seen.append(set(pointers))
            call(pointers, stream)
        monkeypatch.setattr(zt._offload, name, recording)
    for inputs, labels in data(4):
        train(plain, plain_optimizer, inputs, labels)
        torch.nn.functional.cross_entropy(model(inputs[0]), labels[0]).backward()
        stepping[0] = True
        optimizer.step()
        stepping[0] = False
        optimizer.zero_grad(set_to_none=True)
        same(plain, plain_optimizer, model, optimizer)
        # Each parameter's own tensor again, not scratch.
        assert {p.untyped_storage().data_ptr() for p in model.parameters()} == homes
    assert not any(each & homes for each in begun), "the step hinted a parameter's use"
    assert set().union(*pinned) >= homes, "a parameter was not pinned for its window"
    bounced = zt.step_figures(optimizer)["bounced_parameter_bytes"]
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert bounced == (4 * parameter_bytes if place == "host" else 0)
    # The states (all "host" here) went through scratch too, in each step after the first
    # made them: what Note [The fast recipe, advised] counts as moved without the engine.
    state_bytes = sum(-(-v.numel() * v.element_size() // 512) * 512
                      for state in optimizer.state.values() for v in state.values()
                      if torch.is_tensor(v) and v.dim() > 0)
    assert zt.step_figures(optimizer)["bounced_state_bytes"] == 3 * state_bytes
    assert engine.open() == 0 and engine.stray_ends == []


def test_each_scratch_buffer_names_the_copy_streams_to_the_allocator(engine, monkeypatch):
    # The copy streams write and read the scratch, which is allocated on the step's stream:
    # unless they are recorded, a move of its chunk under pressure (which fences the
    # streams the allocator knows) could meet copies still in flight.
    model, optimizer = managed(overlap_bytes=0)
    monkeypatch.setattr(zt._offload, "residency_of", lambda pointer: "host")
    made, recorded = [], []
    scratch_buffer = _optimizer_step.WindowedStep.scratch_buffer

    def making(self, *args):
        made.append(scratch_buffer(self, *args))
        return made[-1]
    monkeypatch.setattr(_optimizer_step.WindowedStep, "scratch_buffer", making)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: recorded.append((self, stream)))
    for inputs, labels in data(2):
        train(model, optimizer, inputs, labels)
    copies = list(optimizer._zeroalloc_stepper.streams_of(torch.device("cpu")))
    assert made and len(copies) == 2
    for buffer in made:
        assert all(any(tensor is buffer and stream is copy for tensor, stream in recorded)
                   for copy in copies)


def test_a_window_that_fails_with_its_parameters_in_scratch_leaves_every_parameter_as_it_was(
        engine):
    """A window that raises while its bounced parameters' data is scratch: every parameter
    is its own tensor again, those of the failed window and after it unchanged, every pin
    ends, and the next step steps them all."""
    plain, plain_optimizer = build()
    model, optimizer = managed(overlap_bytes=0)
    inputs, labels = data(2)[0]
    train(plain, plain_optimizer, inputs, labels)
    train(model, optimizer, inputs, labels)  # states exist from here on
    homes = {id(p): p.untyped_storage().data_ptr() for p in model.parameters()}
    before = {id(p): p.detach().clone() for p in model.parameters()}
    stepper = optimizer._zeroalloc_stepper
    windows = []
    original = stepper._original_step

    def failing(self, *args, **kwargs):
        windows.append([p for group in self.param_groups for p in group["params"]])
        if len(windows) == 2:
            assert any(p.untyped_storage().data_ptr() != homes[id(p)] for p in windows[-1]), \
                "the failing window's parameters were not in scratch"
            raise RuntimeError("injected")
        return original(self, *args, **kwargs)

    stepper._original_step = failing
    torch.nn.functional.cross_entropy(model(inputs[0]), labels[0]).backward()
    with pytest.raises(RuntimeError, match="injected"):
        optimizer.step()
    stepped = {id(p) for p in windows[0]}
    for p in model.parameters():
        assert p.untyped_storage().data_ptr() == homes[id(p)]
        assert torch.equal(p, before[id(p)]) != (id(p) in stepped)
    assert engine.open() == 0 and engine.stray_ends == []
    stepper._original_step = original
    optimizer.step()
    assert all(not torch.equal(p, before[id(p)]) for p in model.parameters())
    assert engine.open() == 0 and engine.stray_ends == []


def test_a_window_without_room_for_its_scratch_is_stepped_in_place_bit_for_bit(
        engine, monkeypatch):
    """Note [Stepped in place without room]: a scratch the limit cannot give fails with
    zeroalloc's out-of-memory error; such windows are stepped where their states are (the
    homes, pinned), the small last window through scratch, and training matches plain
    training bit for bit. A refused size is asked once a step; the user is warned once;
    every pin ends."""
    plain, plain_optimizer = build()
    model, optimizer = managed(overlap_bytes=0)
    empty, asked = torch.empty, []

    def limited(*args, dtype=None, **kwargs):
        if dtype is torch.uint8:  # a scratch buffer: over 10,000 bytes has no room
            asked.append(args[0])
            if args[0] > 10_000:
                raise RuntimeError("zeroalloc_malloc: out of memory on the test device: tried "
                                   f"to allocate {args[0]} B (other)")
        return empty(*args, dtype=dtype, **kwargs)

    monkeypatch.setattr(torch, "empty", limited)
    with pytest.warns(UserWarning, match="did not fit under the device limit") as told:
        for number, (inputs, labels) in enumerate(data(5)):
            train(plain, plain_optimizer, inputs, labels)
            asked.clear()
            train(model, optimizer, inputs, labels)
            same(plain, plain_optimizer, model, optimizer)
            assert engine.open() == 0 and engine.stray_ends == []
            if number >= 1:  # states exist: the large windows were refused, each size once
                refused = [size for size in asked if size > 10_000]
                assert refused and len(refused) == len(set(refused)) <= 2, asked
                assert any(size <= 10_000 for size in asked), asked  # the last window's
    assert len([w for w in told if "did not fit" in str(w.message)]) == 1
    figures = zt.step_figures(optimizer)
    windows = len(optimizer._zeroalloc_stepper.plan)
    assert figures["in_place_windows"] == 4 * (windows - 1), (figures, windows)
    assert figures["in_place_bytes"] > 0


def test_windows_are_at_most_a_sixteenth_of_the_device_limit(engine):
    """At least three windows' scratch is on the device at once: under a 256 MiB limit a
    window holds 16 MiB of parameters and states, whatever window_bytes says; AMSGrad's
    three states count once they exist."""
    parameters = [torch.nn.Parameter(torch.zeros(1 << 20)) for _ in range(6)]  # 4 MiB each
    for parameter in parameters:
        parameter.grad = torch.zeros_like(parameter)
    optimizer = torch.optim.AdamW(parameters, amsgrad=True)
    optimizer.step = zt._windowed_step(optimizer, optimizer.step, 1 << 30, 0)
    stepper = optimizer._zeroalloc_stepper
    groups = [group["params"] for group in optimizer.param_groups]
    assert [len(w) for w in stepper.windows(groups)] == [6]  # no limit: one 1 GiB window
    # 4 MiB and two states (before the first step): 12 MiB a parameter, one a window.
    assert [len(w) for w in stepper.windows(groups, 256 << 20)] == [1] * 6
    assert [len(w) for w in stepper.windows(groups, 1 << 30)] == [5, 1]  # 64 MiB windows
    optimizer.step()
    # AMSGrad's three states: 16 MiB a parameter, 4 of them in 64 MiB.
    assert [len(w) for w in stepper.windows(groups, 1 << 30)] == [4, 2]


def test_a_scratch_failure_that_is_not_for_room_fails_the_step(engine, monkeypatch):
    """A device error met allocating scratch, even one that quotes the driver's "out of
    memory", is not a lack of room under the limit: the step fails, every pin ends."""
    model, optimizer = managed(overlap_bytes=0)
    inputs, labels = data(1)[0]
    train(model, optimizer, inputs, labels)  # states exist from here on
    empty = torch.empty

    def broken(*args, dtype=None, **kwargs):
        if dtype is torch.uint8:
            raise RuntimeError("zeroalloc_malloc: cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY "
                               "(out of memory)")
        return empty(*args, dtype=dtype, **kwargs)

    monkeypatch.setattr(torch, "empty", broken)
    torch.nn.functional.cross_entropy(model(inputs[0]), labels[0]).backward()
    with pytest.raises(RuntimeError, match="cuMemCreate failed"):
        optimizer.step()
    assert engine.open() == 0 and engine.stray_ends == []
    assert zt.step_figures(optimizer)["in_place_windows"] == 0


def test_a_state_written_between_staging_and_step_is_staged_again(engine):
    plain, plain_optimizer = build()
    model, optimizer = managed(overlap_bytes=9 * LAYER_BYTES)
    steps = data(4)
    for inputs, labels in steps[:2]:
        train(plain, plain_optimizer, inputs, labels)
        train(model, optimizer, inputs, labels)
    inputs, labels = steps[2]
    for net, opt in ((plain, plain_optimizer), (model, optimizer)):
        torch.nn.functional.cross_entropy(net(inputs[0]), labels[0]).backward()
        for state in opt.state.values():
            state["exp_avg"].mul_(0.5)  # after this backward staged (for `model`)
        opt.step()
        opt.zero_grad(set_to_none=True)
    same(plain, plain_optimizer, model, optimizer)


def test_another_models_backward_does_not_make_an_optimizer_stage(engine):
    model, optimizer = managed(overlap_bytes=9 * LAYER_BYTES)
    other, other_optimizer = managed(overlap_bytes=9 * LAYER_BYTES)
    steps = data(4)
    for inputs, labels in steps[:2]:
        train(model, optimizer, inputs, labels)
    with torch.no_grad():  # writes back what the last step kept
        model(steps[0][0][0]); model(steps[0][0][0])
    before = zt.step_figures(optimizer)["staged_windows"]
    for inputs, labels in steps[2:]:
        train(other, other_optimizer, inputs, labels)
    assert zt.step_figures(optimizer)["staged_windows"] == before
    assert not optimizer._zeroalloc_stepper.staged


class SlowEvent(FakeEvent):
    """An event whose work is not done the first time it is asked."""

    def __init__(self):
        self.asked = 0

    def query(self):
        self.asked += 1
        return self.asked > 1


def test_a_model_hinted_as_one_group_frees_the_kept_scratch_during_its_forward(
        engine, monkeypatch):
    # One hint group for the whole model: its first hint starts the write-back, and no other
    # hint comes before the backward; the forwards of its modules put the states back once
    # the copies are done, so the scratch is not held through the forward's peak.
    model, optimizer = managed(overlap_bytes=9 * LAYER_BYTES, group_bytes=1 << 30)
    stepper = optimizer._zeroalloc_stepper
    monkeypatch.setattr(torch.cuda, "Event", SlowEvent)
    homes = {}
    for number, (inputs, labels) in enumerate(data(4)):
        train(model, optimizer, inputs, labels)
        if number == 0:
            homes = {id(v) for s in optimizer.state.values() for v in s.values()}
    assert stepper.kept, "the last windows' states were not kept after the step"
    seen = []
    hook = model[LAYERS // 2].register_forward_pre_hook(
        lambda module, inputs: seen.append(len(stepper.kept)))
    with torch.no_grad():
        model(data(1)[0][0][0])
    hook.remove()
    assert seen == [0], "the kept scratch was still held in the middle of the forward"
    assert not zt._windowed_steps.kept_states and not zt._windowed_steps.writing_back
    assert {id(v) for s in optimizer.state.values() for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0} <= homes


def record_gradient_class(monkeypatch) -> tuple:
    """(the allocation classes entered, counted; the storage torch.empty_like made while the
    gradient class was current), from now on."""
    entered, inside, made = Counter(), [None], []

    @contextlib.contextmanager
    def recording(name):
        entered[name] += 1
        inside[0] = name
        try:
            yield
        finally:
            inside[0] = None

    original_empty_like = torch.empty_like

    def empty_like(*args, **kwargs):
        tensor = original_empty_like(*args, **kwargs)
        if inside[0] == "gradient":
            made.append(tensor.data_ptr())
        return tensor

    monkeypatch.setattr(_stats, "allocation_class", recording)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    return entered, made


def test_gradients_copied_into_their_class_train_bit_for_bit(engine, monkeypatch):
    # Note [Gradients' class]: the first gradient of each parameter in a backward is copied
    # into the gradient class and adopted as .grad; later micro-batches add into it.
    entered, made = record_gradient_class(monkeypatch)
    plain, plain_optimizer = build()
    model, optimizer = managed(overlap_bytes=9 * LAYER_BYTES, gradient_class=True)
    parameters = len(list(model.parameters()))
    for number, (inputs, labels) in enumerate(data(6)):
        micro = 2 if number in (2, 3) else 1
        for net in (plain, model):
            entered.clear()
            made.clear()
            for m in range(micro):
                loss = torch.nn.functional.cross_entropy(net(inputs[m]), labels[m]) / micro
                loss.backward()
        assert entered["gradient"] == parameters, entered  # once each, per step
        assert sorted(b.grad.data_ptr() for b in model.parameters()) == sorted(made)
        for a, b in zip(plain.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad)
        for opt in (plain_optimizer, optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)
        same(plain, plain_optimizer, model, optimizer)


@pytest.mark.parametrize("trial_s", [1.5, 0.9])
def test_the_gradients_class_is_tried_once_activations_moved_and_kept_only_if_not_slower(
        engine, monkeypatch, trial_s):
    """Note [Gradients' class, decided]: under "auto" the gradients stay where autograd
    puts them until a step moved class other to the host; then they go into their class for
    a trial (a step to settle, three timed), and stay there only when those steps were not
    slower. The numbers are plain training's bit for bit at every step."""
    _, made = record_gradient_class(monkeypatch)  # this step's gradients made in the class
    clock, moved = [0.0], [0]
    monkeypatch.setattr(_gradient_choice.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(_gradient_choice._stats, "moved_bytes",
                        lambda device, name: (moved[0], 0) if name == "other" else (0, 0))
    plain, plain_optimizer = build()
    model, optimizer = managed(overlap_bytes=0, gradient_class="auto")
    choice = optimizer._zeroalloc_stepper.gradients
    parameters = len(list(model.parameters()))
    in_class = []
    for step, (inputs, labels) in enumerate(data(12), start=1):
        made.clear()
        for net in (plain, model):
            torch.nn.functional.cross_entropy(net(inputs[0]), labels[0]).backward()
        in_class.append(len(made) == parameters)
        assert len(made) in (0, parameters), "the class was on for some gradients only"
        hooks = [hasattr(p, "_zeroalloc_gradient_hooked") for p in model.parameters()]
        assert hooks == [in_class[-1]] * parameters, "hooks on the backward while not trying"
        for a, b in zip(plain.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad)
        if step >= 3:
            moved[0] += 64 << 20  # activations went to the host during this step
        clock[0] += trial_s if choice.on else 1.0  # the step's time, as its class was
        for opt in (plain_optimizer, optimizer):
            opt.step()
            opt.zero_grad(set_to_none=True)
        same(plain, plain_optimizer, model, optimizer)
    # Steps 1-2 are not timed; 3-5 are, without the class (step 3 moved activations); 6
    # settles in the class; 7-9 are timed in it; then the choice holds.
    kept = trial_s < 1.0
    assert in_class == [False] * 5 + [True] * 4 + [kept] * 3
    figures = zt.step_figures(optimizer)
    assert figures["gradient_class_mode"] == "auto"
    assert figures["gradient_class"] == ("on" if kept else "off")
    assert figures["gradient_class_pressed_at_step"] == 3
    assert figures["gradient_class_off_s"] == 1.0
    assert figures["gradient_class_on_s"] == pytest.approx(trial_s)


def test_a_trial_that_cannot_hook_the_gradients_leaves_the_class_off_and_no_hook(
        engine, monkeypatch):
    """Hooking the gradients for a trial happens after the step updated the parameters: a
    failure there warns, takes out the hooks made so far and leaves the class off, and the
    step and the training go on with plain training's numbers."""
    made = [0]
    original = _adoption.gradient_into_class

    def failing(parameter, choice):
        made[0] += 1
        if made[0] == 3:
            raise RuntimeError("CUDA error: out of memory")
        return original(parameter, choice)

    clock, moved = [0.0], [0]
    monkeypatch.setattr(_adoption, "gradient_into_class", failing)
    monkeypatch.setattr(_gradient_choice.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(_gradient_choice._stats, "moved_bytes",
                        lambda device, name: (moved[0], 0))
    plain, plain_optimizer = build()
    model, optimizer = managed(overlap_bytes=0, gradient_class="auto")
    for step, (inputs, labels) in enumerate(data(8), start=1):
        for net in (plain, model):
            torch.nn.functional.cross_entropy(net(inputs[0]), labels[0]).backward()
        moved[0] += 64 << 20
        clock[0] += 1.0
        for opt in (plain_optimizer, optimizer):
            if step == 5 and opt is optimizer:
                with pytest.warns(UserWarning, match="stays off: hooking .* out of memory"):
                    opt.step()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        same(plain, plain_optimizer, model, optimizer)
        assert not any(hasattr(p, "_zeroalloc_gradient_hooked")
                       or hasattr(p, "_zeroalloc_gradient_hook") for p in model.parameters())
    assert made[0] == 3
    assert zt.step_figures(optimizer)["gradient_class"] == "off"


def test_gradient_class_follows_zeroalloc_offload_gradients_when_not_given():
    # In fresh processes: the library reads ZEROALLOC_* once, and this process must not set
    # them (pytest runs other files' subprocesses from it).
    import os
    import subprocess
    root = Path(__file__).resolve().parents[2]
    if not (root / "build" / "libzeroalloc.so").exists() and "ZEROALLOC_LIBRARY" not in os.environ:
        pytest.skip("skipped: build/libzeroalloc.so is not built")
    code = "import zeroalloc.torch as zt; print(zt.gradient_class_default())"

    def default_with(**environment):
        env = {key: value for key, value in os.environ.items()
               if not key.startswith("ZEROALLOC_") or key == "ZEROALLOC_LIBRARY"}
        env.update(PYTHONPATH=str(root / "bindings" / "python"), ZEROALLOC_DEVICE="sim",
                   **environment)
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True)

    assert default_with().stdout.split() == ["auto"]  # Note [Gradients' class, decided]
    assert default_with(ZEROALLOC_OFFLOAD_GRADIENTS=" Auto").stdout.split() == ["auto"]
    assert default_with(ZEROALLOC_OFFLOAD_GRADIENTS="1").stdout.split() == ["True"]
    assert default_with(ZEROALLOC_OFFLOAD_GRADIENTS="yes").stdout.split() == ["True"]
    assert default_with(ZEROALLOC_OFFLOAD_GRADIENTS="off").stdout.split() == ["False"]
    bad = default_with(ZEROALLOC_OFFLOAD_GRADIENTS="maybe")
    assert bad.returncode != 0
    assert "ZEROALLOC_OFFLOAD_GRADIENTS='maybe' is not valid" in bad.stderr, bad.stderr[-2000:]


class Delegating(torch.optim.Optimizer):
    """Steps its parameters through an inner optimizer of its own, as
    ZeroRedundancyOptimizer does: its step does not follow its param_groups."""

    def __init__(self, params):
        params = list(params)
        super().__init__(params, {})
        self.inner = torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def step(self, closure=None):
        return self.inner.step(closure)


@pytest.mark.parametrize("kind", ["delegating", "lbfgs"])
def test_an_optimizer_whose_step_does_not_follow_param_groups_steps_each_parameter_once(
        engine, kind, monkeypatch):
    # Note [Steps that follow param_groups]: windows narrow param_groups; a step that ignores
    # them stepped every parameter once per window (several windows here), and LBFGS, which
    # needs its closure, failed. Stepped in one piece, its states are still pinned for the
    # step (every use of the class hinted) and the states it creates join their class.
    moved = []

    def move(tensor, name):
        moved.append(name)
        return tensor.clone()

    monkeypatch.setattr(_adoption, "move_into_class", move)

    def make():
        model, _ = build()
        if kind == "lbfgs":
            return model, torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
        return model, Delegating(model.parameters())

    open_at_boundaries = []
    boundary = engine.step_boundary

    def counted_boundary():
        open_at_boundaries.append(engine.open())
        boundary()

    monkeypatch.setattr(zt._offload, "step_boundary", counted_boundary)
    plain, plain_optimizer = make()
    model, optimizer = make()
    with pytest.warns(UserWarning, match="runs in one piece"):
        optimizer.step = zt._windowed_step(optimizer, optimizer.step, 6 * LAYER_BYTES + 1)
    for inputs, labels in data(3):
        for net, opt in ((plain, plain_optimizer), (model, optimizer)):
            def closure(net=net, opt=opt):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(net(inputs[0]), labels[0])
                loss.backward()
                return loss

            if kind == "lbfgs":
                opt.step(closure)
            else:
                closure()
                opt.step()
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)
    # The delegating one keeps its states in its inner optimizer, out of sight.
    created = sum(1 for state in optimizer.state.values() for value in state.values()
                  if torch.is_tensor(value) and value.dim() > 0 and value.numel() > 0)
    assert (created > 0) == (kind == "lbfgs")
    assert moved == ["optimizer_state"] * created  # once each, after the step that made it
    assert engine.in_place >= 2 * created  # the two steps after the first pinned them all
    assert open_at_boundaries == [0, 0, 0] and not engine.stray_ends  # each pin ended
    # Its parameters too (Note [Parameters parked]: unpinned, one could be parked).
    assert {p.untyped_storage().data_ptr() for p in model.parameters()} <= engine.pinned_ever


def test_a_dropped_optimizer_with_kept_states_is_freed(engine):
    import gc
    import weakref
    model, optimizer = managed(overlap_bytes=9 * LAYER_BYTES)
    for inputs, labels in data(3):
        train(model, optimizer, inputs, labels)
    assert optimizer._zeroalloc_stepper.kept and zt._windowed_steps.kept_states
    dropped = weakref.ref(optimizer)
    del model, optimizer
    gc.collect()
    assert dropped() is None, "the registry of kept states keeps the optimizer alive"
    assert not zt._windowed_steps.kept_states


def test_an_lr_scheduler_made_before_the_windowed_step_does_not_warn(engine):
    import warnings
    model, optimizer = build()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    optimizer.step = zt._windowed_step(optimizer, optimizer.step, 6 * LAYER_BYTES + 1)
    inputs, labels = data(1)[0]
    torch.nn.functional.cross_entropy(model(inputs[0]), labels[0]).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-2)


def test_parameters_unfrozen_or_added_after_offload_get_their_hooks_at_the_next_step(engine):
    model, optimizer = build()
    adopted = []

    def adopt(parameters, hooked):
        for parameter in parameters:  # what _adopt marks
            parameter._zeroalloc_hooked = True
        hooked.extend((parameter, "_zeroalloc_hooked") for parameter in parameters)
        adopted.append([id(p) for p in parameters])
        return []

    head = model[-1]
    head.requires_grad_(False)  # frozen when offload() ran
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter._zeroalloc_hooked = True
    optimizer.step = zt._windowed_step(optimizer, optimizer.step, 6 * LAYER_BYTES + 1,
                                       adopt=adopt)
    inputs, labels = data(1)[0]

    def step():
        torch.nn.functional.cross_entropy(model(inputs[0]), labels[0]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    assert adopted == []  # nothing new
    head.requires_grad_(True)
    step()
    assert adopted == [[id(head.weight), id(head.bias)]]
    extra = torch.nn.Parameter(torch.randn(4))
    optimizer.add_param_group({"params": [extra]})
    step()
    assert adopted[-1] == [id(extra)]
    step()
    assert len(adopted) == 2  # each once


def test_a_plain_subclass_of_a_torch_optimizer_steps_in_windows(engine):
    # Optimizer.__init__ writes a profiling wrapper of the inherited step onto a subclass
    # made first: the step is still torch.optim's, and steps in windows.
    import warnings

    class Renamed(torch.optim.AdamW):
        pass

    model, _ = build()
    optimizer = Renamed(model.parameters(), lr=1e-2, foreach=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimizer.step = zt._windowed_step(optimizer, optimizer.step, 6 * LAYER_BYTES + 1)
    assert optimizer._zeroalloc_stepper.by_groups


def test_only_states_the_step_pins_join_the_optimizer_state_class(engine, monkeypatch):
    # A fused or capturable Adam keeps its step count as a 0-dim tensor on the device; the
    # windowed step never pins it, and unhinted use must not share the hinted class.
    moved = []
    monkeypatch.setattr(_adoption, "move_into_class", lambda tensor, name: moved.append(name) or
                        tensor.clone())
    model, optimizer = build()
    torch.nn.functional.cross_entropy(model(torch.randn(2, WIDTH)), torch.tensor([0, 1])).backward()
    optimizer.step()
    counts = [state["step"] for state in optimizer.state.values()]
    assert all(torch.is_tensor(count) and count.dim() == 0 for count in counts)
    zt._adopt([], optimizer)
    assert moved == ["optimizer_state"] * (2 * len(counts))  # exp_avg and exp_avg_sq
    assert all(state["step"] is count for state, count in zip(optimizer.state.values(), counts))


def test_a_second_offload_of_a_stepped_optimizer_sets_its_sizes_and_keeps_one_step(
        engine, monkeypatch):
    # With the package installed, ZEROALLOC_OFFLOAD=host starts the automatic mode, which
    # wraps every optimizer's step when it is made: an explicit offload() then must apply
    # its sizes to that step, add no second set of module hooks, and leave the automatic
    # mode's step in place when its handle is removed.
    monkeypatch.setattr(_settings, "require_offload_engine", lambda: None)
    monkeypatch.setattr(_module_hints, "automatic",
                        [type("Hints", (), {"reset": lambda self: None})()])
    installed = []
    monkeypatch.setattr(_module_hints, "install_hint_hooks",
                        lambda model, group_bytes: installed.append(model) or [])
    model, optimizer = build()
    optimizer.step = zt._windowed_step(optimizer, optimizer.step, 1 << 30, overlap_bytes=0)
    wrapped = optimizer.step
    stepper = optimizer._zeroalloc_stepper
    handle = zt.offload(model, optimizer, window_bytes=6 * LAYER_BYTES + 1,
                        overlap_bytes=1 << 20, gradient_class=False)
    assert optimizer.step is wrapped and optimizer._zeroalloc_stepper is stepper
    assert stepper.window_bytes == 6 * LAYER_BYTES + 1 and stepper.overlap_bytes == 1 << 20
    assert stepper in zt._windowed_steps.overlapping
    assert installed == []  # the automatic mode's global hooks hint every module
    plain, plain_optimizer = build()
    for inputs, labels in data(2):
        for net, opt in ((plain, plain_optimizer), (model, optimizer)):
            torch.nn.functional.cross_entropy(net(inputs[0]), labels[0]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert len(stepper.plan) > 1  # stepped in the new, smaller windows
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)
    handle.remove()  # the earlier sizes come back; the step stays the earlier wrapper's
    assert optimizer.step is wrapped and optimizer._zeroalloc_stepper is stepper
    assert stepper.window_bytes == 1 << 30 and stepper.overlap_bytes == 0
    assert stepper not in zt._windowed_steps.overlapping and stepper.adopt is None


def hook_count(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) + \
        len(model._state_dict_hooks) + len(model._state_dict_pre_hooks) + \
        len(model._load_state_dict_pre_hooks) + len(model._load_state_dict_post_hooks)


def test_an_optimizer_made_again_on_one_model_adds_no_second_set_of_hooks(engine, monkeypatch):
    # A program that makes its optimizer again (a new learning-rate phase, a restart) calls
    # offload() once per optimizer on one model: the model's hint, state-dict and load hooks
    # stay one set, so each forward sends each hint once, and they go with the last handle.
    monkeypatch.setattr(_settings, "require_offload_engine", lambda: None)
    model, first = build()
    for parameter in model.parameters():  # as adoption marks CUDA parameters
        parameter._zeroalloc_adopted = True
    bare = hook_count(model)
    handle = zt.offload(model, first, overlap_bytes=0, gradient_class=False)
    once = hook_count(model)
    assert once > bare
    hints = []
    monkeypatch.setattr(zt._offload, "use_begins_many",
                        lambda pointers, stream=0: hints.append(len(pointers)))
    inputs, labels = data(1)[0]
    train(model, first, inputs, labels)
    hinted_once = sum(hints)
    assert hinted_once > 0
    second = torch.optim.AdamW(model.parameters(), lr=1e-3)
    again = zt.offload(model, second, overlap_bytes=0, gradient_class=False)
    assert hook_count(model) == once
    hints.clear()
    train(model, second, inputs, labels)
    assert sum(hints) == hinted_once
    handle.remove()  # the second optimizer's run still hints its model
    assert hook_count(model) == once
    hints.clear()
    train(model, second, inputs, labels)
    assert sum(hints) == hinted_once
    handle.remove()  # a second remove() of one handle lets go of nothing more
    assert hook_count(model) == once
    again.remove()
    assert hook_count(model) == bare


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_a_model_under_offload_pickles_and_its_copy_carries_nothing_of_zeroalloc(
        engine, monkeypatch, how):
    # Note [Nothing of ours is pickled]: torch.save(model) pickles the modules' hooks and
    # the parameters' attributes. It failed on offload()'s hooks ("cannot pickle
    # 'weakref.ReferenceType' object"); the copy comes back with inert hooks and unmarked
    # parameters, and trains as the original does.
    import copy as copying
    import io
    from zeroalloc.torch._transient import MARK
    monkeypatch.setattr(_settings, "require_offload_engine", lambda: None)
    model, optimizer = build()
    for parameter in model.parameters():  # as adoption marks CUDA parameters
        parameter._zeroalloc_adopted = MARK
    handle = zt.offload(model, optimizer, overlap_bytes=0, gradient_class=False)
    inputs, labels = data(1)[0]
    train(model, optimizer, inputs, labels)
    if how == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copy = torch.load(buffer, weights_only=False)
    else:
        copy = copying.deepcopy(model)
    assert not any(getattr(p, "_zeroalloc_adopted", False) or
                   getattr(p, "_zeroalloc_hooked", False) for p in copy.parameters())
    hints = []
    monkeypatch.setattr(zt._offload, "use_begins_many",
                        lambda pointers, stream=0: hints.append(len(pointers)))
    plain = copying.deepcopy(copy)
    with torch.no_grad():
        assert torch.equal(copy(inputs[0]), model(inputs[0]))
    assert hints and sum(hints) == sum(1 for _ in model.parameters())  # the original's only
    copy_optimizer = torch.optim.AdamW(copy.parameters(), lr=1e-2)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    train(copy, copy_optimizer, inputs, labels)
    train(plain, plain_optimizer, inputs, labels)
    for a, b in zip(copy.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    handle.remove()


def test_offload_of_an_optimizer_over_storageless_parameters_leaves_its_step_as_made(
        engine, monkeypatch):
    # FSDP2's sharded DTensors have no storage of their own: FSDP2 owns their memory and
    # their step. offload() says so once and leaves the optimizer as PyTorch made it, as the
    # automatic mode does; the program trains as natively.
    monkeypatch.setattr(_settings, "require_offload_engine", lambda: None)
    model, optimizer = build()
    plain, plain_optimizer = build()
    storageless = next(model.parameters())
    real_pointer = _use_hints.storage_pointer
    monkeypatch.setattr(_use_hints, "storage_pointer",
                        lambda t: 0 if t is storageless else real_pointer(t))
    monkeypatch.setattr(_adoption, "unmanaged_told", set())
    step = optimizer.step
    with pytest.warns(UserWarning, match="Parameter have no storage of their own"):
        handle = zt.offload(model, optimizer, overlap_bytes=0, gradient_class=False)
    assert optimizer.step == step and not hasattr(optimizer, "_zeroalloc_stepper")
    for inputs, labels in data(2):
        train(plain, plain_optimizer, inputs, labels)
        train(model, optimizer, inputs, labels)
    same(plain, plain_optimizer, model, optimizer)
    handle.remove()


def test_an_optimizer_of_cpu_parameters_steps_as_without_zeroalloc(monkeypatch):
    """The automatic mode wraps every optimizer: one over parameters in host memory has
    nothing paged and no CUDA streams, and steps as it would without zeroalloc (it raised
    asking for a CUDA device)."""
    monkeypatch.setattr(_stats, "allocation_class", lambda name: contextlib.nullcontext())
    plain, plain_optimizer = build()
    model, optimizer = build()
    optimizer.step = zt._windowed_step(optimizer, optimizer.step, 6 * LAYER_BYTES + 1,
                                       9 * LAYER_BYTES)
    for inputs, labels in data(3):
        train(plain, plain_optimizer, inputs, labels)
        train(model, optimizer, inputs, labels)
    same(plain, plain_optimizer, model, optimizer)
    zt._windowed_steps.overlapping.clear()


def test_a_dropped_model_and_optimizer_go_at_del_without_the_cycle_collector(engine):
    """Note [No cycles through the optimizer]: the windowed step, the state-dict wrappers and
    an LR scheduler's wrapper hold the optimizer weakly, so that its memory goes at `del`
    (as without zeroalloc), not at the collector's next run."""
    import gc
    import weakref
    gc.collect()
    gc.disable()
    try:
        model, optimizer = managed(overlap_bytes=0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for inputs, labels in data(2):
            train(model, optimizer, inputs, labels)
            scheduler.step()
        optimizer.load_state_dict(optimizer.state_dict())
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.25e-2)
        dropped_optimizer, dropped_weight = weakref.ref(optimizer), weakref.ref(model[0][0].weight)
        del model, optimizer, scheduler
        assert dropped_optimizer() is None, "the optimizer waits for the cycle collector"
        assert dropped_weight() is None, "the model waits for the cycle collector"
    finally:
        gc.enable()


def test_remove_puts_the_optimizers_own_methods_back(engine):
    model, optimizer = build()
    handle = zt.OffloadHandle([], optimizer, zt._original_of(optimizer, "step"))
    optimizer.step = zt._windowed_step(optimizer, optimizer.step, 6 * LAYER_BYTES + 1)
    zt._readopt_after_load(optimizer)
    assert "step" in vars(optimizer) and "state_dict" in vars(optimizer)
    handle.remove()
    for name in ("step", "state_dict", "load_state_dict"):
        assert name not in vars(optimizer), name
    assert not hasattr(optimizer, "_zeroalloc_stepper")


def test_the_windowed_step_reads_as_a_bound_method(engine):
    """What wrappers of optimizer.step read (functools.wraps, inspect.signature) sees the
    step's function without `self`, as through a bound method."""
    import functools
    import inspect
    model, optimizer = managed(overlap_bytes=0)
    assert "self" not in inspect.signature(optimizer.step).parameters
    wrapper = functools.wraps(optimizer.step)(lambda *args, **kwargs: None)
    assert getattr(wrapper, "_zeroalloc_windowed", False)
    assert optimizer.step.__self__ is optimizer


def test_with_step_marks_each_iteration_marks_one_boundary_windowed_or_not(engine):
    # zt.install() registers a global optimizer post-hook that marks a step boundary for
    # reports (zeroalloc/torch/_step_marks.py); an optimizer under the windowed step, whose
    # own step runs once per window, marks its own boundary and is left out by the hook.
    from zeroalloc.torch import _step_marks
    _step_marks.mark_every_optimizer_step()
    _step_marks.mark_every_optimizer_step()  # once per process: a second call adds nothing
    try:
        model, optimizer = managed(overlap_bytes=0)
        steps = data(3)
        for inputs, labels in steps:
            train(model, optimizer, inputs, labels)
        assert engine.boundaries == 3
        plain, plain_optimizer = build()
        for inputs, labels in steps:
            train(plain, plain_optimizer, inputs, labels)
        assert engine.boundaries == 6
    finally:
        _step_marks.stop_marking()
    plain_optimizer.step()
    assert engine.boundaries == 6  # removed


def test_a_boundary_marked_for_another_optimizer_pins_the_kept_states_again(engine):
    # An optimizer zt.offload does not manage marks a boundary of its own (_step_marks),
    # which closes every use. The windowed step's kept states stay pinned between its steps,
    # and the forward writes them back: pinned again, as the windowed step's own boundary
    # pins them, so that no move of the engine meets that write.
    from zeroalloc.torch import _step_marks
    model, optimizer = managed(overlap_bytes=9 * LAYER_BYTES)
    stepper = optimizer._zeroalloc_stepper
    steps = data(3)
    for inputs, labels in steps[:2]:
        train(model, optimizer, inputs, labels)
    pinned = sum(1 for e in stepper.kept if e.pinned)
    assert pinned and engine.open() == pinned
    _step_marks.mark_every_optimizer_step()
    try:
        plain, plain_optimizer = build()
        train(plain, plain_optimizer, *steps[2])
    finally:
        _step_marks.stop_marking()
    assert engine.boundaries == 3
    assert engine.open() == pinned, "the kept states' pins were left closed"


def state_tensors(state: dict) -> list:
    """The state tensors of an optimizer's state (or a state dict's), step counts left out."""
    return [value for per in state.values() for value in per.values()
            if torch.is_tensor(value) and value.numel() > 1]


def trained_states():
    """A managed model's optimizer after one step, and its state tensors."""
    model, optimizer = managed(overlap_bytes=0)
    inputs, labels = data(1)[0]
    train(model, optimizer, inputs, labels)
    return optimizer, state_tensors(optimizer.state)


def test_state_dict_copies_states_on_disk_out_while_a_use_pins_them(engine, monkeypatch):
    # States in the NVMe tier sit behind addresses no copy may touch, and may go back there
    # after state_dict() returns: the dict holds CPU copies of them, each made under a use
    # in place (which brings it back and pins it), ended at once; the others are the
    # optimizer's own tensors (zeroalloc/torch/_state_dict.py).
    optimizer, states = trained_states()
    on_disk = {states[0].untyped_storage().data_ptr(), states[3].untyped_storage().data_ptr()}
    monkeypatch.setattr(zt._offload, "residency_of",
                        lambda pointer: "disk" if pointer in on_disk else "host")
    pinned, ended = recorded_pins(monkeypatch)
    saved = optimizer.state_dict()
    assert sorted(pinned) == sorted(on_disk) and sorted(ended) == sorted(on_disk)
    values = state_tensors(saved["state"])
    assert len(values) == len(states)
    for value, state in zip(values, states):
        assert torch.equal(value, state) and value.device.type == "cpu"


def test_with_the_disk_tier_state_dict_copies_every_managed_state(engine, monkeypatch):
    # With ZEROALLOC_NVME_PATH, a state on the host or the device as state_dict() looks may
    # be on disk by the time torch.save reads it: every state the engine manages comes out
    # as a CPU copy made under a use in place; memory it does not hold stays as it is.
    from zeroalloc.torch import _settings
    optimizer, states = trained_states()
    foreign = states[1].untyped_storage().data_ptr()
    held = {s.untyped_storage().data_ptr() for s in states} - {foreign}
    monkeypatch.setattr(_settings, "disk_tier", lambda: True)
    monkeypatch.setattr(zt._offload, "residency_of",
                        lambda pointer: "host" if pointer in held else "foreign")
    pinned, ended = recorded_pins(monkeypatch)
    saved = optimizer.state_dict()
    managed_states = [s.untyped_storage().data_ptr() for s in states
                      if s.untyped_storage().data_ptr() != foreign]
    assert sorted(pinned) == sorted(ended) == sorted(managed_states)
    for value, state in zip(state_tensors(saved["state"]), states):
        copied = value.untyped_storage().data_ptr() != state.untyped_storage().data_ptr()
        assert torch.equal(value.cpu(), state.cpu())
        assert copied == (state.untyped_storage().data_ptr() != foreign)


@pytest.mark.parametrize("access", ["any", "hinted"])
def test_tensors_split_between_device_and_host_stay_themselves_under_any_access(
        engine, monkeypatch, access):
    # Under ZEROALLOC_ACCESS=any a tensor whose chunks lie partly on the host is addressable
    # as it is: model.state_dict() and optimizer.state_dict() hold the tensors themselves,
    # on their device, as natively (an EMA updated through state_dict() adds them to CUDA
    # tensors). Under hinted, such a tensor may hold a parked chunk: it is copied out.
    from zeroalloc.torch import _settings
    monkeypatch.setattr(_settings, "require_offload_engine", lambda: None)
    monkeypatch.setattr(_settings, "any_access", lambda: access == "any")
    model, optimizer = build()
    handle = zt.offload(model, optimizer, overlap_bytes=0, gradient_class=False)
    train(model, optimizer, *data(1)[0])
    monkeypatch.setattr(zt._offload, "residency_of", lambda pointer: "split")
    monkeypatch.setattr("zeroalloc.torch._state_dict.residency_or_foreign",
                        lambda tensor: "split")
    pinned, ended = recorded_pins(monkeypatch)
    saved, states = model.state_dict(), optimizer.state_dict()["state"]
    own = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {v.untyped_storage().data_ptr() for v in saved.values()}
    own_states = {v.untyped_storage().data_ptr() for v in state_tensors(optimizer.state)}
    kept_states = {v.untyped_storage().data_ptr() for v in state_tensors(states)}
    if access == "any":
        assert kept == own and kept_states == own_states and pinned == []
    else:
        assert not (kept & own) and not (kept_states & own_states) and pinned
    assert sorted(pinned) == sorted(ended)
    handle.remove()


def recorded_pins(monkeypatch):
    """The pointers the library is asked to pin in place and to unpin, in two lists."""
    pinned, ended = [], []
    monkeypatch.setattr(zt._offload, "use_in_place_many",
                        lambda pointers, stream=0: pinned.extend(pointers))
    monkeypatch.setattr(zt._offload, "use_ends_many",
                        lambda pointers, stream=0: ended.extend(pointers))
    return pinned, ended


def test_model_state_dict_copies_parameters_on_disk_out_while_a_use_pins_them(engine,
                                                                            monkeypatch):
    # ZEROALLOC_NVME_PARAMETERS: a parameter in the NVMe tier sits behind addresses no copy
    # may touch. Under offload(), model.state_dict() holds a CPU copy of each such one, made
    # under a use in place ended at once; the others are the parameters' own tensors.
    from zeroalloc.torch import _settings
    monkeypatch.setattr(_settings, "require_offload_engine", lambda: None)
    monkeypatch.setattr(_settings, "parameters_park", lambda: False)  # ZEROALLOC_PARK_PARAMETERS=0
    model, optimizer = build()
    handle = zt.offload(model, optimizer, overlap_bytes=0, gradient_class=False)
    inputs, labels = data(1)[0]
    train(model, optimizer, inputs, labels)
    parameters = dict(model.named_parameters())
    names_on_disk = {"0.0.weight", "3.0.bias"}
    on_disk = {parameters[name].untyped_storage().data_ptr() for name in names_on_disk}
    monkeypatch.setattr(zt._offload, "residency_of",
                        lambda pointer: "disk" if pointer in on_disk else "device")
    pinned, ended = recorded_pins(monkeypatch)
    saved = model.state_dict()
    assert sorted(pinned) == sorted(on_disk) and sorted(ended) == sorted(on_disk)
    assert saved.keys() == parameters.keys()
    for name, value in saved.items():
        assert torch.equal(value, parameters[name]), name
        copied = value.untyped_storage().data_ptr() != parameters[name].untyped_storage().data_ptr()
        assert copied == (name in names_on_disk), name
    handle.remove()  # the hook goes with the rest
    pinned.clear()
    model.state_dict()
    assert pinned == []


@pytest.mark.parametrize("park", [True, False])
def test_with_parking_on_the_model_state_dict_copies_every_managed_parameter(engine,
                                                                             monkeypatch, park):
    # Note [Parameters parked]: any managed parameter may be parked once the copies' uses end
    # (an eviction as a use ends), and torch.save would read unmapped addresses: each one is
    # a CPU copy made under a use in place; memory the engine does not hold stays as it is.
    # So too with parameters in the NVMe tier (ZEROALLOC_NVME_PARAMETERS) and parking off:
    # one on the device as state_dict() looks may be on disk when torch.save reads it.
    from zeroalloc.torch import _settings
    monkeypatch.setattr(_settings, "require_offload_engine", lambda: None)
    monkeypatch.setattr(_settings, "parameters_park", lambda: park)
    monkeypatch.setattr(_settings, "parameters_on_disk", lambda: not park)
    model, optimizer = build()
    handle = zt.offload(model, optimizer, overlap_bytes=0, gradient_class=False)
    parameters = dict(model.named_parameters())
    for parameter in parameters.values():  # what adoption marks on the GPU
        parameter._zeroalloc_adopted = True
    foreign = parameters["1.0.weight"].untyped_storage().data_ptr()
    places = {foreign: "foreign", parameters["0.0.weight"].untyped_storage().data_ptr():
              "host_unmapped"}
    monkeypatch.setattr(zt._offload, "residency_of",
                        lambda pointer: places.get(pointer, "device"))
    monkeypatch.setattr("zeroalloc.torch._step_records.residency_or_foreign",
                        lambda tensor: places.get(tensor.untyped_storage().data_ptr(), "device"))
    monkeypatch.setattr("zeroalloc.torch._state_dict.residency_or_foreign",
                        lambda tensor: places.get(tensor.untyped_storage().data_ptr(), "device"))
    pinned, ended = recorded_pins(monkeypatch)
    saved = model.state_dict()
    managed = {name for name, p in parameters.items() if p.untyped_storage().data_ptr() != foreign}
    assert sorted(pinned) == sorted(ended) == sorted(
        parameters[name].untyped_storage().data_ptr() for name in managed)
    for name, value in saved.items():
        assert torch.equal(value, parameters[name]), name
        copied = value.untyped_storage().data_ptr() != parameters[name].untyped_storage().data_ptr()
        assert copied == (name in managed), name
    handle.remove()


@pytest.mark.parametrize("park", [True, False])
def test_load_state_dict_pins_the_managed_parameters_it_writes(engine, monkeypatch, park):
    # Note [Parameters parked]: load_state_dict writes every parameter without a hint; with
    # parking on, the managed ones are pinned where they are from its start to its end, in
    # offload()'s hooks and in the no-code-change mode's wrapper alike.
    from zeroalloc.torch import _state_dict
    monkeypatch.setattr(_settings, "require_offload_engine", lambda: None)
    monkeypatch.setattr(_settings, "parameters_park", lambda: park)
    model, optimizer = build()
    source = copy.deepcopy(model.state_dict())
    for p in source.values():
        p.add_(1)
    handle = zt.offload(model, optimizer, overlap_bytes=0, gradient_class=False)
    for parameter in model.parameters():  # what adoption marks on the GPU
        parameter._zeroalloc_adopted = True
    pointers = {p.untyped_storage().data_ptr() for p in model.parameters()}
    during = []
    original = torch.Tensor.copy_

    def copy_(self, other, *args, **kwargs):  # what the load writes, and what is pinned then
        if self.untyped_storage().data_ptr() in pointers:
            during.append(engine.pins[self.untyped_storage().data_ptr()] > 0)
        return original(self, other, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    model.load_state_dict(source)
    monkeypatch.setattr(torch.Tensor, "copy_", original)
    assert during and all(during) == park and (park or not any(during))
    assert engine.open() == 0 and not engine.stray_ends  # every pin ended
    for name, p in model.named_parameters():
        assert torch.equal(p, source[name])
    handle.remove()
    # The no-code-change mode: every module's load is wrapped, the outermost pins.
    monkeypatch.setattr(torch.nn.Module, "state_dict", torch.nn.Module.state_dict)
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", torch.nn.Module.load_state_dict)
    _state_dict.copy_parameters_off_disk_in_every_model()
    engine.pinned_ever.clear()
    model.load_state_dict(source)
    assert (engine.pinned_ever == pointers) == park and engine.open() == 0


def test_without_offload_every_models_state_dict_copies_parameters_on_disk_once(engine,
                                                                                 monkeypatch):
    # The no-code-change mode knows no model: every module's state_dict is wrapped, and only
    # the outermost call (the whole model's dict) copies, each parameter on disk once.
    from zeroalloc.torch import _settings, _state_dict
    monkeypatch.setattr(_settings, "parameters_park", lambda: False)  # ZEROALLOC_PARK_PARAMETERS=0
    monkeypatch.setattr(torch.nn.Module, "state_dict", torch.nn.Module.state_dict)
    _state_dict.copy_parameters_off_disk_in_every_model()
    _state_dict.copy_parameters_off_disk_in_every_model()  # once: a second call wraps nothing
    model, _ = build()
    parameters = dict(model.named_parameters())
    on_disk = {parameters["2.0.weight"].untyped_storage().data_ptr()}
    monkeypatch.setattr(zt._offload, "residency_of",
                        lambda pointer: "disk" if pointer in on_disk else "device")
    pinned = []
    monkeypatch.setattr(zt._offload, "use_in_place_many",
                        lambda pointers, stream=0: pinned.extend(pointers))
    saved = model.state_dict()
    assert pinned == list(on_disk)
    assert saved["2.0.weight"].untyped_storage().data_ptr() not in on_disk
    assert torch.equal(saved["2.0.weight"], parameters["2.0.weight"])
    pinned.clear()
    inner = model[2].state_dict()  # a submodule's own call is outermost too
    assert pinned == list(on_disk) and set(inner) == {"0.weight", "0.bias"}


def test_a_new_optimizer_state_is_written_into_its_class_under_a_hint(monkeypatch):
    """Note [States never used yet]: a state may go to disk before any hint reached it, so
    even its first write (the copy into the optimizer-state class) is hinted, in place, and
    the hint ends after it; other classes are copied without hints."""
    calls = []

    class Device:
        is_cuda = True

        def copy_(self, source):
            calls.append("copy")

    monkeypatch.setattr(_stats, "allocation_class", lambda name: contextlib.nullcontext())
    monkeypatch.setattr(torch, "empty_like", lambda tensor: Device())
    monkeypatch.setattr(_use_hints, "hint",
                        lambda call, tensors, stream: calls.append(call.__name__))
    _adoption.move_into_class(torch.zeros(4), "optimizer_state")
    assert calls == ["use_in_place_many", "copy", "use_ends_many"]
    calls.clear()
    _adoption.move_into_class(torch.zeros(4), "parameter")
    assert calls == ["copy"]


@pytest.mark.parametrize("bounce", [True, False])
def test_a_window_whose_parameters_are_pinned_waits_for_the_pins_stream(engine, monkeypatch,
                                                                         bounce):
    # Note [Parameters parked]: a parameter on the device when its residency was asked may
    # be parked before its window is pinned, and the pin fetches it back in copy_in's order.
    # So a window that pins parameters (Note [Parameters stepped where they are]) has the
    # step wait for copy_in even when it copies nothing into scratch.
    monkeypatch.setattr(zt._offload, "residency_of", lambda pointer: "device")
    waited = []
    monkeypatch.setattr(FakeStream, "wait_event", lambda self, event: waited.append(event))
    model, optimizer = managed(overlap_bytes=0)
    optimizer._zeroalloc_stepper.bounce_parameters = bounce
    inputs, labels = data(1)[0]
    train(model, optimizer, inputs, labels)
    windows = len(optimizer._zeroalloc_stepper.plan)
    assert windows >= 2
    assert (len(waited) >= windows) if bounce else not waited
