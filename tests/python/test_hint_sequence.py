"""The use hints zeroalloc.torch's module hooks send, on CPU tensors (PyTorch without a GPU
is enough): which parameters each forward and backward begins and ends, for zt.offload's
hooks and for the automatic mode's global ones. The engine is replaced by a recorder; every
use begun must end, once, whatever the model does (containers inside a layer, outputs in a
dict, a part called alone, a forward that raises, a module reachable from two parents), and
a layer is hinted in one call.

    python3 -m pytest tests/python/test_hint_sequence.py
"""

import copy
import gc
import sys
import weakref
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bindings" / "python"))
import zeroalloc.torch as zt  # noqa: E402
from zeroalloc.torch import _use_hints  # noqa: E402


class Attention(torch.nn.Module):  # a container: its weights sit in its children
    def __init__(self, width):
        super().__init__()
        self.q, self.o = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        return self.o(torch.tanh(self.q(x)))


class Layer(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.attention = Attention(width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return {"hidden": self.norm(x + self.attention(x))}  # a mapping, as ModelOutput is


class Model(torch.nn.Module):
    def __init__(self, width=16, layers=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer(width) for _ in range(layers))
        self.head = torch.nn.Linear(width, width)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)["hidden"]
        return self.head(x)


def layer_bytes(width=16):
    return sum(p.numel() * p.element_size() for p in Layer(width).parameters())


class Recorder:
    """Stands in for the engine: records each begin and end call with the parameters'
    names, and counts open uses per parameter. And it parks as the engine may: a parameter
    with no use open holds NaN, its values coming back when a use begins, so that a kernel
    reading a parameter outside its uses (a backward that reads one no use covers) computes
    NaN where the engine's parked chunk would fault."""

    def __init__(self, model):
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.parameters = weakref.WeakValueDictionary({id(p): p for p in model.parameters()})
        self.calls = []
        self.open = Counter()
        self.parked = {}  # id -> the values of a parameter holding NaN

    def begin(self, tensors, stream=0):
        names = tuple(self.names.get(id(t), "?") for t in tensors)
        self.calls.append(("begin", names))
        for tensor, name in zip(tensors, names):
            if self.open[name] == 0 and id(tensor) in self.parked:
                tensor.data.copy_(self.parked.pop(id(tensor)))  # as a move: no new version
        self.open.update(names)

    def end(self, tensors, stream=0):
        names = tuple(self.names.get(id(t), "?") for t in tensors)
        self.calls.append(("end", names))
        self.open.subtract(names)
        for tensor, name in zip(tensors, names):
            if (self.open[name] == 0 and id(tensor) in self.parameters
                    and id(tensor) not in self.parked and tensor.is_floating_point()):
                self.parked[id(tensor)] = tensor.detach().clone()
                tensor.data.fill_(float("nan"))

    def take(self):
        calls, self.calls = self.calls, []
        return calls

    def unbalanced(self):
        return {name: count for name, count in self.open.items() if count}


@pytest.fixture
def recorder(monkeypatch):
    holder = {}

    def make(model):
        recorder = Recorder(model)
        holder["recorder"] = recorder
        monkeypatch.setattr(_use_hints, "begin", recorder.begin)
        monkeypatch.setattr(_use_hints, "end", recorder.end)
        for parameter in model.parameters():  # what zt.offload's adoption does
            parameter._zeroalloc_adopted = True
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(zt._end_backward)
        zt._adoptions[0] += 1
        return recorder

    return make


def begins(calls):
    return [names for kind, names in calls if kind == "begin"]


def hooked_with_reference(recorder, hooked, model_class=None, **install):
    """A model (seeded), an unhooked copy of it for reference, and the recorder of the
    model's hints with its hooks installed."""
    torch.manual_seed(0)
    model = (model_class or Model)()
    reference = copy.deepcopy(model)
    record = recorder(model)
    hooked(model, **install)
    return model, reference, record


def same_gradients(model, reference):
    """Whether the model's gradients are the reference's, bit for bit (a parameter read
    while parked made them NaN)."""
    for (name, parameter), twin in zip(model.named_parameters(), reference.parameters()):
        if (parameter.grad is None) != (twin.grad is None):
            return False
        if parameter.grad is not None and not torch.equal(parameter.grad, twin.grad):
            return False
    return True


@pytest.fixture(params=["offload", "automatic"])
def hooked(request):
    """Installs zt.offload's module hooks, or the automatic mode's global ones, with a
    group size that holds one Layer; takes them out after the test."""
    handles = []

    def install(model, group_bytes=None):
        size = layer_bytes() if group_bytes is None else group_bytes
        if request.param == "offload":
            handles.extend(zt._install_hint_hooks(model, size))
        else:
            hints = zt._AutomaticHints(size)
            module = torch.nn.modules.module
            handles.append(module.register_module_forward_pre_hook(hints.before))
            handles.append(module.register_module_forward_hook(hints.after, always_call=True))
        return request.param

    yield install
    for handle in handles:
        handle.remove()


def test_a_layer_is_one_call_forward_and_backward_and_every_use_ends(recorder, hooked):
    model, reference, record = hooked_with_reference(recorder, hooked)
    x = torch.randn(3, 16)
    loss = model(x).sum()
    forward = record.take()
    layer = ("attention.q.weight", "attention.q.bias", "attention.o.weight",
             "attention.o.bias", "norm.weight", "norm.bias")
    assert begins(forward) == [tuple(f"layers.{i}.{n}" for n in layer) for i in (0, 1)] + [
        ("head.weight", "head.bias")], forward
    loss.backward()
    backward = begins(record.take())
    # One begin per group, through the dict output too, of what its forward saved: a
    # Linear's weight (for its input's gradient; not the first one's, whose input needs
    # none), a LayerNorm's weight and bias, no Linear's bias. Each gradient ends its use.
    assert backward == [("head.weight",),
                        tuple(f"layers.1.{n}" for n in ("attention.q.weight",
                              "attention.o.weight", "norm.weight", "norm.bias")),
                        tuple(f"layers.0.{n}" for n in ("attention.o.weight", "norm.weight",
                              "norm.bias"))], backward
    assert record.unbalanced() == {}
    reference(x).sum().backward()
    assert same_gradients(model, reference), "the backward read a parameter no use covered"


def test_under_autocast_a_linear_weight_gets_no_backward_use(recorder, hooked):
    """Note [The backward reads what autograd saved]: under autocast a Linear saves the
    bf16 copy of its weight, so the fp32 weight stays parked through the backward; the
    LayerNorm (fp32 under autocast) saves its own."""
    model, reference, record = hooked_with_reference(recorder, hooked)
    x = torch.randn(3, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().sum()
    record.take()
    loss.backward()
    backward = begins(record.take())
    assert backward == [tuple(f"layers.{i}.norm.{n}" for n in ("weight", "bias"))
                        for i in (1, 0)], backward
    assert record.unbalanced() == {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference(x).float().sum().backward()
    assert same_gradients(model, reference), "the backward read a parameter no use covered"


def test_every_parameter_comes_back_for_the_backward_with_backward_uses_all(
        recorder, hooked, monkeypatch):
    monkeypatch.setenv("ZEROALLOC_BACKWARD_USES", "all")
    model = Model()
    record = recorder(model)
    hooked(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(3, 16)).float().sum()
    forward = begins(record.take())
    loss.backward()
    assert sorted(begins(record.take())) == sorted(forward)
    assert record.unbalanced() == {}


def test_saved_tensor_hooks_around_the_model_still_see_every_saved_tensor(recorder, hooked):
    """Under hooks of other code around the model (save_on_cpu, a checkpoint) the watch
    stands aside: those hooks pack and unpack as often as without the module hooks."""
    model, reference, record = hooked_with_reference(recorder, hooked)
    x = torch.randn(3, 16, requires_grad=True)

    def run(net):
        counts = Counter()

        def pack(tensor):
            counts["pack"] += 1
            return ("held", tensor.detach().clone())  # as save_on_cpu does, a copy

        def unpack(packed):
            counts["unpack"] += 1
            return packed[1]

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            loss = net(x).sum()
        loss.backward()
        return counts

    counts = run(model)
    assert counts == run(reference) and counts["pack"] > 0, counts
    assert same_gradients(model, reference)
    assert record.unbalanced() == {}


def test_a_part_called_alone_hints_itself_and_a_raising_forward_closes_its_group(
        recorder, hooked):
    model = Model()
    record = recorder(model)
    hooked(model)
    x = torch.randn(3, 16)
    model.layers[0].attention.q(x)
    assert begins(record.take()) == [("layers.0.attention.q.weight", "layers.0.attention.q.bias")]
    with pytest.raises(RuntimeError):
        model(torch.randn(3, 5))  # fails in the first layer's first Linear
    record.take()
    assert record.unbalanced() == {}
    with torch.no_grad():
        model.layers[0].attention.q(x)  # the failed forward's group is not running any more
    assert begins(record.take()) == [("layers.0.attention.q.weight", "layers.0.attention.q.bias")]
    assert record.unbalanced() == {}


class _Explode(torch.autograd.Function):
    """Identity forward; a backward that raises (an out-of-memory error, say)."""

    @staticmethod
    def forward(context, x):
        return x.view_as(x)

    @staticmethod
    def backward(context, gradient):
        raise RuntimeError("backward failed (the test's)")


class ExplodingAttention(Attention):
    def forward(self, x):
        return self.o(_Explode.apply(torch.tanh(self.q(x))))


def test_a_backward_that_raises_ends_its_uses_and_holds_no_parameter(recorder, hooked):
    """Note [Backward uses]: autograd runs a backward's end callback only when it succeeds;
    the uses a failed backward began (here q's, whose gradient never came) end when it
    raises, and its bookkeeping holds no parameter of a model that is dropped."""
    model = Model()
    model.layers[1].attention = ExplodingAttention(16)
    record = recorder(model)
    hooked(model)
    loss = model(torch.randn(3, 16)).sum()
    with pytest.raises(RuntimeError, match="the test's"):
        loss.backward()
    record.take()
    assert record.unbalanced() == {}, "uses of the failed backward stay open"
    weight = weakref.ref(model.layers[1].attention.q.weight)
    del model, loss
    gc.collect()
    assert weight() is None, "the failed backward's bookkeeping keeps the parameters"


def test_a_copy_of_a_hooked_model_computes_the_same_and_hints_nothing(recorder, hooked):
    """An EMA or AveragedModel deep-copies the model, hooks included: the copy must work,
    and, not being offload()'s, send no hints of its own."""
    model = Model()
    record = recorder(model)
    mode = hooked(model)
    twin = copy.deepcopy(model)
    record.take()
    x = torch.randn(3, 16)
    with torch.no_grad():
        same = torch.equal(twin(x), model(x))
    assert same
    calls = record.take()
    if mode == "offload":
        copied = [names for names in begins(calls) if "?" in names]
        assert copied == [], "the copy hinted its parameters"
    assert record.unbalanced() == {}


class Detached(torch.nn.Module):
    """Reads its weight through detach() and .data (views sharing its storage, not the
    parameter): the backward still reads them for the input's gradient."""

    def __init__(self, width=16):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        x = torch.nn.functional.linear(x, self.a.weight.detach(), self.a.bias)
        return torch.nn.functional.linear(x, self.b.weight.data, self.b.bias)


def test_a_weight_read_through_detach_or_data_comes_back_for_the_backward(recorder, hooked):
    model, reference, record = hooked_with_reference(recorder, hooked, Detached,
                                                     group_bytes=1 << 20)
    data = torch.randn(3, 16)
    x = data.clone().requires_grad_()
    model(x).sum().backward()
    assert begins(record.take())[-1] == ("a.weight", "b.weight")
    twin = data.clone().requires_grad_()
    reference(twin).sum().backward()
    assert torch.equal(x.grad, twin.grad), "the input's gradient read a parked weight"
    assert record.unbalanced() == {}


class Identity(torch.autograd.graph.saved_tensors_hooks):
    """Hooks that save each tensor as it is (as activation-offloading tools' no-op
    managers do)."""

    def __init__(self):
        super().__init__(lambda tensor: tensor, lambda tensor: tensor)


def test_hooks_pushed_inside_a_forward_make_every_parameter_come_back(recorder, hooked):
    """Hooks that other code pushes inside a module's forward hide what they save from the
    watch: that module's backward then brings back every parameter, as without the watch."""

    class Inside(Model):
        def forward(self, x):
            with Identity():
                return super().forward(x)

    torch.manual_seed(0)
    model = Inside()
    reference = copy.deepcopy(model)
    record = recorder(model)
    hooked(model, group_bytes=1 << 30)  # one group: the hooks sit inside its forward
    data = torch.randn(3, 16)
    x = data.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x).float().sum()
    forward = begins(record.take())
    loss.backward()
    assert begins(record.take()) == forward  # every parameter, autocast or not
    twin = data.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference(twin).float().sum().backward()
    assert same_gradients(model, reference) and torch.equal(x.grad, twin.grad)
    assert record.unbalanced() == {}


@pytest.mark.parametrize("theirs_first", [True, False])
def test_hooks_pushed_by_module_hooks_in_any_order_leave_the_stack_as_it_was(
        recorder, hooked, theirs_first):
    """Activation offloading that pushes its hooks in a forward pre-hook and pops them in a
    forward hook, registered before or after zeroalloc's: the stack ends empty each step,
    their hooks see what they would without zeroalloc's, and the gradients are right."""
    torch.manual_seed(0)
    model = Model()
    reference = copy.deepcopy(model)
    record = recorder(model)
    counts = Counter()

    class Counting(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self):
            def pack(tensor):
                counts["pack"] += 1
                return tensor.detach()
            super().__init__(pack, lambda tensor: tensor)

    manager = Counting()
    head = model.head
    if theirs_first:
        head.register_forward_pre_hook(lambda *_: manager.__enter__())
        head.register_forward_hook(lambda *_: manager.__exit__(None, None, None))
    hooked(model, group_bytes=1)  # head hints itself
    if not theirs_first:
        head.register_forward_pre_hook(lambda *_: manager.__enter__())
        head.register_forward_hook(lambda *_: manager.__exit__(None, None, None))
    data = torch.randn(3, 16)
    for _ in range(2):
        x = data.clone().requires_grad_()
        model(x).sum().backward()
        assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    assert counts["pack"] > 0
    for _ in range(2):
        twin = data.clone().requires_grad_()
        reference(twin).sum().backward()
    assert same_gradients(model, reference) and torch.equal(x.grad, twin.grad)
    assert record.unbalanced() == {}


def test_a_weight_changed_in_place_before_the_backward_is_still_an_error(recorder, hooked):
    """The watch's pack hook keeps autograd's check of saved tensors' versions."""
    model = Model()
    recorder(model)
    hooked(model)
    loss = model(torch.randn(3, 16, requires_grad=True)).sum()
    with torch.no_grad():
        model.head.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_outputs_in_several_tensors_begin_a_backward_once(recorder, hooked):
    class Split(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.a(x), self.b(x)  # both outputs carry gradients

    model = torch.nn.Sequential(Split())
    record = recorder(model)
    hooked(model, group_bytes=1 << 20)
    first, second = model(torch.randn(2, 8, requires_grad=True))
    record.take()
    (first.sum() + second.sum()).backward()
    assert begins(record.take()) == [("0.a.weight", "0.b.weight")]
    assert record.unbalanced() == {}


def test_a_module_reachable_from_two_parents_is_hinted_once_per_call(recorder, hooked):
    shared = torch.nn.Linear(8, 8)
    model = torch.nn.Module()
    model.left = torch.nn.Sequential(shared)
    model.alias = shared  # the same module under a second parent
    model.forward = lambda x: model.left(x)
    record = recorder(model)
    hooked(model, group_bytes=1)  # every module too large: each hints its own parameters
    model(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert begins(record.take()) == [("left.0.weight", "left.0.bias"), ("left.0.weight",)]
    assert record.unbalanced() == {}


def test_a_module_used_twice_and_a_tied_weight_begin_one_backward_use(recorder, hooked):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 8)
            self.twice = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight  # tied, as language models do

        def forward(self, tokens):
            return self.head(self.twice(self.twice(self.embed(tokens))))

    model = Tied()
    record = recorder(model)
    hooked(model, group_bytes=1)  # each module hints itself
    loss = model(torch.tensor([[1, 2, 3]])).sum()
    forward = begins(record.take())
    assert Counter(forward) == {("embed.weight",): 2, ("twice.weight", "twice.bias"): 2}
    loss.backward()
    calls = record.take()
    # Two forward uses each, one backward use each of what was saved (the tied weight for the
    # head's input gradient): the gradients end them once.
    assert Counter(begins(calls)) == {("embed.weight",): 1, ("twice.weight",): 1}
    assert record.unbalanced() == {}, (record.unbalanced(), calls)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("group_bytes", [1, 1 << 30])  # each module alone; the whole model
def test_checkpointed_layers_end_every_use(recorder, hooked, reentrant, group_bytes):
    import torch.utils.checkpoint as checkpoint

    class Checkpointed(Model):
        def forward(self, x):
            for layer in self.layers:
                x = checkpoint.checkpoint(lambda y, layer=layer: layer(y)["hidden"], x,
                                          use_reentrant=reentrant)
            return self.head(x)

    model, reference, record = hooked_with_reference(recorder, hooked, Checkpointed,
                                                     group_bytes=group_bytes)
    data = torch.randn(3, 16)
    x = data.clone().requires_grad_()
    loss = model(x).sum()
    names = [name for name, _ in model.named_parameters()]
    forward = Counter(name for group in begins(record.take()) for name in group)
    assert forward == {name: 1 for name in names}
    loss.backward()
    # The backward begins the use of every parameter the layers read (the recomputation
    # inside the backward begins those it saved at once, its outputs' gradients may never
    # come; its forward begins every parameter again); the gradients are the plain model's.
    backward = Counter(name for group in begins(record.take()) for name in group)
    read = {name for name in names if not name.endswith(("q.bias", "o.bias", "head.bias"))}
    assert read <= set(backward), backward
    assert record.unbalanced() == {}
    twin = data.clone().requires_grad_()
    Checkpointed.forward(reference, twin).sum().backward()
    assert same_gradients(model, reference), "the backward read a parameter no use covered"
    assert torch.equal(x.grad, twin.grad), "the input's gradient read a parked weight"
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_uses_no_gradient_reaches_end_with_the_backward(recorder, hooked):
    class Partly(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.frozen, self.trained = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.unused = torch.nn.Linear(8, 8)  # an expert no token reached
            self.frozen.requires_grad_(False)

        def forward(self, x):
            return self.frozen(x) + self.trained(x)

    model = Partly()
    record = recorder(model)
    hooked(model, group_bytes=1 << 20)  # one group: its backward begins what it saved
    saved = ("frozen.weight", "trained.weight")  # for the input's gradient
    x = torch.randn(2, 8, requires_grad=True)
    loss = model(x).sum()
    record.take()
    loss.backward()
    calls = record.take()
    assert begins(calls) == [saved]
    # The trained layer's gradient ends its use; the backward's end ends the frozen one's.
    assert calls[-1] == ("end", ("frozen.weight",)), calls
    assert record.unbalanced() == {}
    loss = model(x).sum()
    record.take()
    torch.autograd.grad(loss, x)  # no parameter's gradient accumulated
    assert record.take() == [("begin", saved), ("end", saved)]
    assert record.unbalanced() == {}


def test_a_module_returning_a_parameter_adds_no_hook_to_it(recorder, hooked):
    class Position(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Parameter(torch.randn(4, 8))

        def forward(self):
            return self.table

    model = Position()
    record = recorder(model)
    hooked(model, group_bytes=1 << 20)
    for _ in range(3):
        model().sum().backward()
    assert record.take() == [("begin", ("table",)), ("end", ("table",))] * 3
    assert len(model.table._backward_hooks or {}) == 0
    assert record.unbalanced() == {}


def test_the_automatic_mode_lets_a_dropped_model_go(recorder):
    hints = zt._AutomaticHints(layer_bytes())
    module = torch.nn.modules.module
    handles = [module.register_module_forward_pre_hook(hints.before),
               module.register_module_forward_hook(hints.after, always_call=True)]
    try:
        model = Model()
        recorder(model)
        model(torch.randn(3, 16))
        alive = [weakref.ref(each) for each in (model, model.layers[0], model.head)]
        del model
        gc.collect()
        assert [ref() for ref in alive] == [None] * 3, (
            "the automatic mode's group table kept the model alive")
    finally:
        for handle in handles:
            handle.remove()


def test_hints_for_tensors_on_several_devices_are_fenced_on_each_devices_stream(monkeypatch):
    # A model split over two GPUs in one process: each part's hints go on its own device's
    # current stream, not the current device's (a fence there would not cover the part).
    import types

    class OnDevice:
        def __init__(self, index, pointer):
            self.index, self.pointer = index, pointer

        def get_device(self):
            return self.index

        def untyped_storage(self):
            return types.SimpleNamespace(data_ptr=lambda: self.pointer)

    monkeypatch.setattr(_use_hints, "current_stream",
                        lambda device_index=None: 100 + (device_index or 0))
    calls = []

    def record(pointers, stream):
        calls.append((pointers, stream))

    zt._hint(record, [OnDevice(0, 1), OnDevice(1, 2), OnDevice(0, 3)], 0)
    assert sorted(calls) == [([1, 3], 100), ([2], 101)]
    calls.clear()
    zt._hint(record, (OnDevice(1, 2),), 0)
    assert calls == [([2], 101)]
    calls.clear()
    zt._hint(record, [OnDevice(1, 2)], 7)  # a stream given is the stream used
    assert calls == [([2], 7)]


def test_a_compiled_model_runs_its_hooks_outside_the_graph_only(recorder, hooked):
    """Note [Hints and torch.compile]: under torch.compile the hooks stand down inside the
    compiled region (Dynamo traces none of their bookkeeping, which once failed with
    "already tracked for mutation"), and the model computes what it computes uncompiled."""
    torch._dynamo.reset()
    model, reference, record = hooked_with_reference(recorder, hooked)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(3, 16)
    compiled(x).sum().backward()
    record.take()
    assert record.unbalanced() == {}, "a use begun in a compiled region never ended"
    reference(x).sum().backward()
    assert same_gradients(model, reference)
    assert torch.equal(compiled(x), reference(x))
    torch._dynamo.reset()


class NoStorage(torch.Tensor):
    """A wrapper subclass, as FSDP2's DTensor is: its storage is null, and asking for the
    storage's data pointer raises."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, NoStorage) else t  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


def test_tensors_without_storage_of_their_own_are_left_out_of_hints():
    """FSDP2's DTensors and storages FSDP resized to nothing: the hints name only the
    tensors whose storage the library could manage, and never raise for the others."""
    plain = torch.randn(4)
    wrapped = NoStorage(torch.randn(4))
    with pytest.raises(RuntimeError):
        wrapped.untyped_storage().data_ptr()  # what failed in the module hints before
    freed = torch.randn(4)
    freed.untyped_storage().resize_(0)
    assert _use_hints.storage_pointer(wrapped) == 0
    assert _use_hints.storage_pointer(freed) == 0
    assert _use_hints.pointers([plain, wrapped, freed]) == [plain.untyped_storage().data_ptr()]
