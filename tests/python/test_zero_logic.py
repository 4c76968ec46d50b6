"""ZeRO's ownership and buckets (zeroalloc/torch/_zero.py), without ranks: who owns which
parameter, which parameters one broadcast carries, and which gradients one reduce of stage 2
carries."""

import contextlib
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bindings" / "python"))

from zeroalloc._library import ZeroallocError  # noqa: E402
from zeroalloc.torch import _adoption, _module_hints, _zero, _zero_parameters  # noqa: E402
from zeroalloc.torch._gradient_choice import GradientChoice  # noqa: E402


def test_owners_are_contiguous_runs_of_about_equal_bytes():
    sizes = [100] * 10
    assert _zero.owners_by_bytes(sizes, 2) == [0] * 5 + [1] * 5
    assert _zero.owners_by_bytes(sizes, 4) == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    # A parameter goes to the rank its middle byte falls in; every rank is in range.
    owners = _zero.owners_by_bytes([1, 1000, 1], 3)
    assert owners == sorted(owners) and all(0 <= o < 3 for o in owners)
    assert _zero.owners_by_bytes([8], 4) == [2]  # one parameter: the middle byte's rank
    assert _zero.owners_by_bytes([0, 0], 2) == [0, 0]  # nothing to split


def test_a_bucket_holds_one_owners_run_up_to_the_size_and_a_large_parameter_alone():
    small = [torch.zeros(1024) for _ in range(4)]  # 4 KiB each
    large = torch.zeros((_zero.BUCKET_BYTES // 4) + 1)  # just over a bucket
    parameters = small[:2] + [large] + small[2:]
    found = _zero.buckets(parameters, [0, 0, 0, 1, 1])
    assert [(owner, [id(p) for p in members]) for owner, members in found] == [
        (0, [id(small[0]), id(small[1])]), (0, [id(large)]), (1, [id(small[2]), id(small[3])])]


def test_a_parameter_that_is_not_contiguous_is_refused_with_its_shape():
    strided = torch.zeros(4, 6).t()
    with pytest.raises(ZeroallocError, match=r"shape \(6, 4\) is not contiguous"):
        _zero.buckets([strided], [0])


def test_a_reduce_carries_one_owners_gradients_in_backward_order_one_dtype_at_a_time():
    a, b, c = torch.zeros(1024), torch.zeros(1024), torch.zeros(1024)
    half = torch.zeros(1024, dtype=torch.bfloat16)
    frozen = torch.zeros(1024)
    for parameter in (a, b, c, half):
        parameter.requires_grad_(True)
    found = _zero.gradient_buckets([a, b, frozen, half, c], [0, 0, 0, 1, 1])
    # Reversed (a backward makes the last layer's gradients first); a frozen parameter has
    # none; a bfloat16 gradient does not share a float32 one's buffer.
    assert [(owner, [id(p) for p in members]) for owner, members in found] == [
        (1, [id(c)]), (1, [id(half)]), (0, [id(b), id(a)])]


def test_stage_3_needs_the_model_and_a_stage_beyond_it_is_named():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"pass the model"):
        _zero.partition(optimizer, stage=3)
    with pytest.raises(ValueError, match=r"stage 4 does not exist"):
        _zero.partition(optimizer, stage=4)


def test_stage_3_under_offload_leaves_the_others_parameters_to_their_owners(monkeypatch):
    """Note [Stage 3 under offload]: a rank's own parameters stay offload's (their mark, which
    the module hints read); the others' leave its management and adoption passes them over;
    the owner's parameters are pinned where they are around whatever reads them for a gather
    (the packing of a run, or the broadcast of a single one) and for model.state_dict()'s
    copy, the others' never; and when the partition ends, the others' are put back in the
    parameter class."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2),
                                torch.nn.Linear(2, 2, bias=False))
    parameters = list(model.parameters())  # w0 b0 (rank 0), w1 b1 (rank 1), w2 (rank 0)
    for parameter in parameters:
        parameter._zeroalloc_adopted = True  # what zt.offload's adoption marks
    owners = [0, 0, 1, 1, 0]
    owner_of = {id(p): owner for p, owner in zip(parameters, owners)}
    name = {id(p): key for key, p in zip(["w0", "b0", "w1", "b1", "w2"], parameters)}
    events = []

    @contextlib.contextmanager
    def pinned_where_they_are(tensors):
        if tensors:
            events.append(("pin", [name[id(t)] for t in tensors]))
        yield
        if tensors:
            events.append(("unpin", [name[id(t)] for t in tensors]))

    monkeypatch.setattr(_zero_parameters, "pinned_where_they_are", pinned_where_they_are)
    monkeypatch.setattr(_zero_parameters._group, "broadcast",
                        lambda pointer, size, root, stream: events.append(("broadcast", root)))
    moved = []
    monkeypatch.setattr(_zero_parameters, "move_into_class",
                        lambda tensor, name: (moved.append(name), tensor.clone())[1])
    shards = _zero_parameters.ParameterShards(model, owner_of, 0,
                                              {"gathers": 0, "gathered_bytes": 0})
    assert [p._zeroalloc_adopted for p in parameters] == [True, True, False, False, True]
    assert [p.numel() for p in parameters] == [16, 4, 0, 0, 4]
    assert _module_hints.managed(model[0]) == parameters[:2]
    assert _module_hints.managed(model[1]) == []  # no hint names the gathered copies
    # A later adoption (an offload() after the partition) passes the others' over.
    assert _adoption.adopt(parameters[2:4]) == [] and not parameters[2]._zeroalloc_adopted

    model(torch.ones(1, 4, requires_grad=True)).sum().backward()
    forward = [("pin", ["w0", "b0"]), ("unpin", ["w0", "b0"]), ("broadcast", 0),
               ("broadcast", 1), ("pin", ["w2"]), ("broadcast", 0), ("unpin", ["w2"])]
    # The backward gathers each module again, last first.
    backward = [("pin", ["w2"]), ("broadcast", 0), ("unpin", ["w2"]), ("broadcast", 1),
                ("pin", ["w0", "b0"]), ("unpin", ["w0", "b0"]), ("broadcast", 0)]
    assert events == forward + backward
    shards.release_all()  # as the end of a partition's backward does
    events.clear()
    model.state_dict()
    assert ("pin", ["w1"]) not in events and ("pin", ["w0"]) in events  # the copy, pinned
    assert [p.numel() for p in parameters] == [16, 4, 0, 0, 4]  # the others' let go again
    shards.remove()
    assert [p.numel() for p in parameters] == [16, 4, 8, 2, 4]
    assert moved == ["parameter", "parameter"]
    assert [p._zeroalloc_adopted for p in parameters] == [True] * 5
    assert not any(hasattr(p, "_zeroalloc_not_owned") for p in parameters)


def test_stage_2_divides_each_gradient_as_it_arrives_into_offloads_gradient_class(monkeypatch):
    """A first gradient of a parameter whose gradients offload keeps in their class is
    divided into that class (the accumulation adopts what the hook returns); the others
    where they are."""
    classes = []

    @contextlib.contextmanager
    def allocation_class(name):
        classes.append(name)
        yield

    monkeypatch.setattr(_zero._stats, "allocation_class", allocation_class)
    hooked, plain, waiting = (torch.nn.Parameter(torch.ones(4)) for _ in range(3))
    hooked._zeroalloc_gradient_hooked = GradientChoice(True)
    # Note [Gradients' class, decided]: hooked by the automatic choice, not on yet.
    waiting._zeroalloc_gradient_hooked = GradientChoice("auto")
    with torch.no_grad():  # as in a backward
        for parameter in (hooked, plain, waiting):
            assert torch.equal(_zero.predivision(parameter, 0.5)(torch.full((4,), 3.0)),
                               torch.full((4,), 1.5))
        assert classes == ["gradient"]
        hooked.grad = torch.zeros(4)  # later gradients are added into it: a temporary
        _zero.predivision(hooked, 0.5)(torch.ones(4))
    assert classes == ["gradient"]


def test_a_broadcast_of_parameters_pins_those_on_gpus_for_its_collectives(monkeypatch):
    """Note [Collectives on paged parameters]: the pins open before the first collective and
    end after the last, on the parameters' streams; tensors off the GPUs are left alone."""
    calls = []
    monkeypatch.setattr(_zero_parameters._use_hints, "hint",
                        lambda call, tensors, stream: calls.append((call.__name__, len(tensors))))
    cpu = [torch.nn.Parameter(torch.ones(4))]
    with _zero.pinned_where_they_are(cpu):
        calls.append(("collective", 0))
    assert calls == [("collective", 0)]
    if not torch.cuda.is_available():
        return
    calls.clear()
    gpu = [torch.nn.Parameter(torch.ones(4, device="cuda")) for _ in range(3)]
    with pytest.raises(RuntimeError, match="injected"):
        with _zero.pinned_where_they_are(cpu + gpu):
            calls.append(("collective", 0))
            raise RuntimeError("injected")  # the pins still end
    assert calls == [("use_in_place_many", 3), ("collective", 0), ("use_ends_many", 3)]
