"""ZeRO stage 3 (zt.partition(stage=3, model=...)) under torchrun on the simulated device:
each rank keeps only the parameters it owns, gathering the others while a module uses them,
forward and backward (with activation checkpointing too); losses and the owners' parameters
stay bit for bit DistributedDataParallel's, and the model's state_dict gathers every
parameter."""

import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = Path(os.environ.get("ZEROALLOC_LIBRARY", ROOT / "build" / "libzeroalloc.so"))
if not LIBRARY.exists():
    pytest.skip(f"skipped: {LIBRARY} is not built", allow_module_level=True)
pytest.importorskip("torch.distributed.run", reason="skipped: PyTorch (torchrun) is not installed")

sys.path.insert(0, str(ROOT / "tests" / "python"))
from test_group import run_ranks  # noqa: E402

PROGRAM = """
import torch
import torch.distributed as dist
import torch.utils.checkpoint
import zeroalloc.torch as zt

dist.init_process_group("gloo")  # DistributedDataParallel's, for the model compared with
rank = dist.get_rank()


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(32, 64)
        self.middle = torch.nn.Sequential(
            *[layer for _ in range(6) for layer in (torch.nn.Linear(64, 64), torch.nn.ReLU())])
        self.last = torch.nn.Linear(64, 8)
        self.checkpointing = False

    def forward(self, x):
        x = torch.relu(self.first(x))
        if self.checkpointing:  # recomputed in the backward: gathered again there
            x = torch.utils.checkpoint.checkpoint(self.middle, x, use_reentrant=False)
        else:
            x = self.middle(x)
        return self.last(torch.relu(x))


plain = torch.nn.parallel.DistributedDataParallel(Model())
parted = Model()  # not wrapped: stage 3 reduces the gradients itself
plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
parted_optimizer = torch.optim.AdamW(parted.parameters(), lr=1e-2)
handle = zt.partition(parted_optimizer, stage=3, model=parted, timeout_s=30)
mine = [owner == rank for owner in handle.owners]
inputs = torch.Generator().manual_seed(100 + rank)  # each rank its own data


def held():  # only what it owns, whole; the others empty
    return all((p.numel() != 0) == own for p, own in zip(parted.parameters(), mine))


def owners_same():
    return all(torch.equal(a, b) for a, b, own in
               zip(plain.module.parameters(), parted.parameters(), mine) if own)


print(f"rank {rank} partitioned holds {held()}", flush=True)
# What a rank holds while a module runs: its own parameters and the layers in flight, no
# more: the module running, and in the backward the one whose gradients are still being
# made (each module's are let go when its forward ends or its gradients are made).
owned_elements = sum(p.numel() for p in parted.parameters())
largest_module = max(sum(handle.shards.shape_of(p).numel() for p in m._parameters.values()
                         if p is not None) for m in parted.modules())
peak = [0]


def measure(module, inputs):
    peak[0] = max(peak[0], sum(p.numel() for p in parted.parameters()))


for module in parted.modules():
    if any(p is not None for p in module._parameters.values()):
        module.register_forward_pre_hook(measure)  # after the gathering hook

for step in range(5):
    checkpointing = step >= 3
    plain.module.checkpointing = parted.checkpointing = checkpointing
    losses = []
    for model, optimizer in ((plain, plain_optimizer), (parted, parted_optimizer)):
        optimizer.zero_grad()
    for micro in range(2 if checkpointing else 1):
        x, y = torch.randn(16, 32, generator=inputs), torch.randn(16, 8, generator=inputs)
        for model in (plain, parted):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.detach())
    plain_optimizer.step()
    parted_optimizer.step()
    exact = not checkpointing  # accumulated: the sums' order differs
    # Losses come from the parameters before the step: bit for bit until an accumulated
    # step has made them differ in their last bits.
    check = torch.equal if step <= 3 else (lambda a, b: torch.allclose(a, b, rtol=1e-5))
    same_loss = all(check(a, b) for a, b in zip(losses[0::2], losses[1::2]))
    same = owners_same() if exact else all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b, own in
        zip(plain.module.parameters(), parted.parameters(), mine) if own)
    print(f"rank {rank} step {step} loss {same_loss} owners {same} holds {held()}", flush=True)
# A backward that accumulates nothing (torch.autograd.grad of an input) after the step's
# backward: its gathered copies must not outlive the step, or the next forward would run on
# the weights from before it.
plain.module.checkpointing = parted.checkpointing = False
for probe in (True, False):
    x, y = torch.randn(16, 32, generator=inputs), torch.randn(16, 8, generator=inputs)
    losses = []
    for model, module, optimizer in ((plain, plain.module, plain_optimizer),
                                     (parted, parted, parted_optimizer)):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.detach())
        if probe:
            probed = x.clone().requires_grad_()
            torch.autograd.grad(module(probed).sum(), probed)
        optimizer.step()
    close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b, own in
                zip(plain.module.parameters(), parted.parameters(), mine) if own)
    print(f"rank {rank} probe {probe} loss {torch.allclose(*losses, rtol=1e-5)} "
          f"owners {close} holds {held()}", flush=True)
whole_elements = sum(handle.shards.shape_of(p).numel() for p in parted.parameters())
assert owned_elements + 2 * largest_module < whole_elements  # else the bound says nothing
print(f"rank {rank} in flight {peak[0] <= owned_elements + 2 * largest_module} "
      f"({peak[0]} of {owned_elements} owned + 2 x {largest_module})", flush=True)
whole = parted.state_dict()
reference = plain.module.state_dict()
gathered = (whole.keys() == reference.keys() and
            all(torch.allclose(whole[k], reference[k], rtol=1e-5, atol=1e-7) for k in whole))
print(f"rank {rank} state_dict gathered {gathered} holds {held()}", flush=True)
handle.remove()  # every parameter back, on every rank
print(f"rank {rank} removed whole {all(p.numel() != 0 for p in parted.parameters())}",
      flush=True)
"""


def test_each_rank_keeps_its_parameters_and_gathers_the_rest_as_modules_use_them(tmp_path):
    script = tmp_path / "stage3.py"
    script.write_text(textwrap.dedent(PROGRAM))
    run = run_ranks(script, ZEROALLOC_REPORT=str(tmp_path / "run"))
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} partitioned holds True" in output, output[-3000:]
        for step in range(5):
            assert f"rank {rank} step {step} loss True owners True holds True" in output, \
                output[-3000:]
        for probe in (True, False):
            assert f"rank {rank} probe {probe} loss True owners True holds True" in output, \
                output[-3000:]
        assert f"rank {rank} in flight True" in output, output[-3000:]
        assert f"rank {rank} state_dict gathered True holds True" in output, output[-3000:]
        assert f"rank {rank} removed whole True" in output, output[-3000:]
    for rank in (0, 1):
        zero = json.loads((tmp_path / f"run.rank{rank}.json").read_text())["sections"]["zero"]
        assert zero["stage"] == 3 and zero["steps"] == 7, zero
        assert zero["broadcasts"] == 0, zero  # nothing shared after a step: gathered at use
        assert zero["gathers"] > 0 and zero["reduces"] > 0, zero
