"""The optimizer step that zt.offload installs (Note [Stepping states where they are] in
zeroalloc/torch/_optimizer_step.py), on the GPU: with part of the optimizer's states in host
memory, in windows smaller than the model, it gives the parameters and states of PyTorch's
own step bit for bit, for the fused and the foreach AdamW; states it creates land in the
optimizer-state class; a parameter on the host stays there (copied through scratch, not fetched);
a window that fails leaves every state as it was and every hint
closed (the engine's chunks_in_use figure). With overlap_bytes, training through it moves
states during forward and backward and still gives plain training's numbers bit for bit.

    python3 -m pytest -s tests/python/test_windowed_step.py
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"
LIBRARY = Path(os.environ.get("ZEROALLOC_LIBRARY", ROOT / "build" / "libzeroalloc.so")).resolve()

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
if not torch.cuda.is_available():
    pytest.skip("skipped: no CUDA GPU", allow_module_level=True)
if not LIBRARY.is_file():
    pytest.skip(f"skipped: {LIBRARY} is not built", allow_module_level=True)

CHECK = r"""
import sys, torch
import zeroalloc, zeroalloc.torch as zt
zt.install()
flavour = sys.argv[1]
torch.manual_seed(0)
shapes = [(512, 256), (1000, 3), (256,), (64, 64, 3, 3), (4096, 128)]
start = [torch.randn(s, device="cuda") for s in shapes]
grads = [[torch.randn(s, device="cuda") for s in shapes] for _ in range(4)]

def build():
    params = [torch.nn.Parameter(t.clone()) for t in start]
    params[3].data = params[3].data.contiguous(memory_format=torch.channels_last)
    return params, torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **{flavour: True})

plain, plain_optimizer = build()
managed, managed_optimizer = build()
zt.offload(torch.nn.ParameterList(managed), managed_optimizer, window_bytes=400_000)
for number, step_grads in enumerate(grads):
    for params, optimizer in ((plain, plain_optimizer), (managed, managed_optimizer)):
        for p, g in zip(params, step_grads):
            p.grad = torch.empty_like(p).copy_(g)  # the parameter's layout (channels_last)
        optimizer.step()
    if number > 0:  # Note [Parameters stepped where they are]: bounced, not fetched
        torch.cuda.synchronize()
        assert zt.residency(managed[4]) == "host", "the step fetched a host parameter back"
    if number == 0:
        classes = zeroalloc.raw_stats(0)["classes"]
        assert classes["optimizer_state"]["allocated_bytes"]["current"] >= \
            sum(2 * t.numel() * 4 for t in start), classes["optimizer_state"]
    # Half of the states (and one parameter) to the host: the next step bounces them.
    for index, p in enumerate(managed):
        if index % 2 == 0:
            for key in ("exp_avg", "exp_avg_sq"):
                zt.offload_tensor(managed_optimizer.state[p][key])
    zt.offload_tensor(managed[4])
torch.cuda.synchronize()
assert zt.residency(managed_optimizer.state[managed[0]]["exp_avg"]) == "host"
assert zeroalloc.raw_stats(0)["offload"]["in_place_uses"] > 0, "states were not hinted"
for a, b in zip(plain, managed):
    assert torch.equal(a, b), (a - b).abs().max()
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(plain_optimizer.state[a][key], managed_optimizer.state[b][key]), key

# A window that fails: the windows before it are stepped, it and those after are not, and
# every state dict holds its own tensor again (not scratch); the next step works.
objects = {id(p): dict(managed_optimizer.state[p]) for p in managed}
values = {id(p): {k: v.clone() for k, v in managed_optimizer.state[p].items()} for p in managed}
original = torch.optim.AdamW.step
calls = []  # the parameters of each window, in the order stepped
def failing(*args, **kwargs):
    calls.append({id(p) for p in managed_optimizer.param_groups[0]["params"]})
    if len(calls) == 2:
        raise RuntimeError("injected")
    return original(managed_optimizer, *args, **kwargs)
windowed = managed_optimizer.step
managed_optimizer.step = zt._windowed_step(managed_optimizer, failing, 400_000)
for p, g in zip(managed, grads[0]):
    p.grad = torch.empty_like(p).copy_(g)
try:
    managed_optimizer.step()
    raise SystemExit("the injected failure did not surface")
except RuntimeError as failure:
    assert "injected" in str(failure)
assert 0 < len(calls[0]) < len(managed), calls  # one window stepped, not every parameter
torch.cuda.synchronize()
figures = zeroalloc.raw_stats(0)["offload"]
assert figures["chunks_in_use"] == 0, f"hints left open by the failed step: {figures}"
for index, p in enumerate(managed):
    for key in ("exp_avg", "exp_avg_sq"):
        assert managed_optimizer.state[p][key] is objects[id(p)][key], (index, key)
        same = torch.equal(managed_optimizer.state[p][key], values[id(p)][key])
        stepped = id(p) in calls[0]
        assert same != stepped, (index, key, "stepped" if not same else "not stepped")
managed_optimizer.step = windowed
managed_optimizer.step()
torch.cuda.synchronize()
print("windowed step ok", flavour)
"""


OVERLAP_CHECK = r"""
import copy, sys, torch
import torch.nn.functional as F
import zeroalloc, zeroalloc.torch as zt
zt.install()
flavour = sys.argv[1]
width, layers = 256, 12
layer_bytes = (width * width + width) * 4  # one Linear's parameters, fp32

def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
          for _ in range(layers)], torch.nn.Linear(width, 10)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1,
                                  **{flavour: True})
    return model, optimizer

plain, plain_optimizer = build()
managed, managed_optimizer = build()
# Windows of two layers (parameters and two states each); two windows of states overlap.
zt.offload(managed, managed_optimizer, window_bytes=6 * layer_bytes + 1,
           hint_group_bytes=layer_bytes + 4096, overlap_bytes=9 * layer_bytes)
torch.manual_seed(1)
data = [(torch.randn(2, 64, width, device="cuda"), torch.randint(0, 10, (2, 64), device="cuda"))
        for _ in range(12)]

def train(model, optimizer, inputs, labels, micro):
    for m in range(micro):
        loss = F.cross_entropy(model(inputs[m]), labels[m]) / micro
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

def states_equal(where):
    for a, b in zip(plain.parameters(), managed.parameters()):
        assert torch.equal(a, b), (where, (a - b).abs().max().item())
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = plain_optimizer.state[a][key], managed_optimizer.state[b][key]
            assert torch.equal(x, y), (where, key, (x - y).abs().max().item())

def all_states_to_host():
    for state in managed_optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            zt.offload_tensor(state[key])

for number, (inputs, labels) in enumerate(data):
    micro = 2 if 4 <= number < 7 else 1  # gradient accumulation for three steps
    train(plain, plain_optimizer, inputs, labels, micro)
    train(managed, managed_optimizer, inputs, labels, micro)
    if number in (0, 5):
        # Created on the device by the first step. After the fifth, the last windows' states
        # are scratch in the state dict: moving one writes them back and moves its own tensor.
        all_states_to_host()
    if number == 7:  # read between the step and the next forward
        mine, theirs = managed_optimizer.state_dict(), plain_optimizer.state_dict()
        for index, state in theirs["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key], mine["state"][index][key]), (index, key)
    if number == 8:  # loaded between the step and the next forward: kept states go home first
        # (a copy: loading aliases same-device tensors, the step counts of foreach included)
        managed_optimizer.load_state_dict(copy.deepcopy(plain_optimizer.state_dict()))
        all_states_to_host()
    if number == 9:  # a step with no forward before it: writes back what the last one kept
        states_equal(f"before an extra step")
        for a, b in zip(plain.parameters(), managed.parameters()):
            a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
        plain_optimizer.step()
        managed_optimizer.step()
        plain_optimizer.zero_grad(set_to_none=True)
        managed_optimizer.zero_grad(set_to_none=True)
    states_equal(f"step {number}")
torch.cuda.synchronize()
figures = zt.step_figures(managed_optimizer)
print("figures", figures)
assert figures["staged_windows"] >= 2 * 8, figures  # two a step from the second on
assert figures["kept_windows"] >= 2 * 8, figures  # the head and the last two layers
assert figures["written_back_during_forward"] > 0, figures
first = managed_optimizer.state[managed[0][0].weight]  # in the first window: staged, not kept
assert [zt.residency(first[key]) for key in ("exp_avg", "exp_avg_sq")] == ["host"] * 2

def in_use():
    torch.cuda.synchronize()
    return zeroalloc.raw_stats(0)["offload"]["chunks_in_use"]

# Two forwards write back what the last step kept and put the states' own tensors back.
with torch.no_grad():
    managed(data[0][0][0]); torch.cuda.synchronize(); managed(data[0][0][0])
assert in_use() == 0, in_use()
# Another model's backward does not make this optimizer stage (only its own parameters'
# gradients count).
other, other_optimizer = build()
zt.offload(other, other_optimizer, overlap_bytes=9 * layer_bytes)
before = zt.step_figures(managed_optimizer)["staged_windows"]
for inputs, labels in data[:3]:
    train(other, other_optimizer, inputs, labels, 1)
assert zt.step_figures(managed_optimizer)["staged_windows"] == before
# A backward with no step after it stages; the next forward unpins and frees what it staged.
F.cross_entropy(managed(data[0][0][0]), data[0][1][0]).backward()
assert zt.step_figures(managed_optimizer)["staged_windows"] > before
with torch.no_grad():
    managed(data[0][0][0])
assert in_use() == 0, in_use()
print("overlapped step ok", flavour)
"""


def run_check(script: str, flavour: str) -> str:
    env = {key: value for key, value in os.environ.items() if not key.startswith("ZEROALLOC_")}
    env.update({"ZEROALLOC_DEVICE": "cuda", "ZEROALLOC_OFFLOAD": "host",
                "ZEROALLOC_HOST_LIMIT": "2GiB", "ZEROALLOC_LIBRARY": str(LIBRARY),
                "PYTHONPATH": str(PACKAGE)})
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script), flavour], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result.stdout


@pytest.mark.parametrize("flavour", ["fused", "foreach"])
def test_windowed_step_equals_the_plain_step_bit_for_bit(flavour):
    assert f"windowed step ok {flavour}" in run_check(CHECK, flavour)


@pytest.mark.parametrize("flavour", ["fused", "foreach"])
def test_overlapped_step_equals_plain_training_bit_for_bit(flavour):
    """Note [Overlapping the step]: with the optimizer states in host memory, a model
    trained through zt.offload(overlap_bytes=...), whose step stages its first windows'
    states during backward and keeps its last windows' states on the device until the next
    forward, gives the parameters and states of plain PyTorch training bit for bit: with
    gradient accumulation, with state_dict read and load_state_dict called between a step
    and the next forward, with the states moved by hand there, and with a step that runs
    with no forward before it. Another optimizer's backward does not make it stage, and a
    forward after a backward with no step unpins what was staged."""
    out = run_check(OVERLAP_CHECK, flavour)
    assert f"overlapped step ok {flavour}" in out
    print([line for line in out.splitlines() if line.startswith("figures")][-1])
