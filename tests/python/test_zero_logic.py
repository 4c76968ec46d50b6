"""ZeRO's ownership and buckets (zeroalloc/torch/_zero.py), without ranks: who owns which
parameter, which parameters one broadcast carries, and which gradients one reduce of stage 2
carries."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bindings" / "python"))

from zeroalloc._library import ZeroallocError  # noqa: E402
from zeroalloc.torch import _zero  # noqa: E402


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


def test_stages_2_and_3_refuse_an_offloaded_optimizer_naming_what_combines():
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model.weight._zeroalloc_adopted = True  # what zt.offload's adoption marks
    for stage in (2, 3):
        with pytest.raises(ZeroallocError, match=r"does not combine with offload.*stage 1"):
            _zero.partition(optimizer, stage=stage, model=model)
