"""The optimizer step that zt.offload installs (Note [Stepping states where they are] in
zeroalloc/torch.py), on the GPU: with part of the optimizer's states in host memory, in
windows smaller than the model, it gives the parameters and states of PyTorch's own step bit
for bit, for the fused and the foreach AdamW; states it creates land in the optimizer-state
class; a window that fails leaves every state as it was and every hint closed (the engine's
chunks_in_use figure).

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


@pytest.mark.parametrize("flavour", ["fused", "foreach"])
def test_windowed_step_equals_the_plain_step_bit_for_bit(flavour):
    env = {key: value for key, value in os.environ.items() if not key.startswith("ZEROALLOC_")}
    env.update({"ZEROALLOC_DEVICE": "cuda", "ZEROALLOC_OFFLOAD": "host",
                "ZEROALLOC_HOST_LIMIT": "2GiB", "ZEROALLOC_LIBRARY": str(LIBRARY),
                "PYTHONPATH": str(PACKAGE)})
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECK), flavour], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    assert f"windowed step ok {flavour}" in result.stdout
