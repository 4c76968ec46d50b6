"""ZeRO stages 1-3 on a GPU (zt.partition): the collectives go through NCCL on the CUDA
tensors' streams. One rank under torchrun (one GPU): every parameter is the rank's own, so
the reduces and broadcasts run in place, and the model must train bit for bit as the same
model without partitioning does. Stages 1 and 2 also with offload (zt.offload before
zt.partition): every parameter and state of the partitioned model sent to the host after
each step, so the next backward, step and broadcast meet them there."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="skipped: PyTorch is not installed")
if not torch.cuda.is_available():
    pytest.skip("skipped: no CUDA device", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"
LIBRARY = Path(os.environ.get("ZEROALLOC_LIBRARY", ROOT / "build" / "libzeroalloc.so"))
if not LIBRARY.exists():
    pytest.skip(f"skipped: {LIBRARY} is not built", allow_module_level=True)

sys.path.insert(0, str(ROOT / "tests" / "python"))
from test_group import free_port  # noqa: E402

PROGRAM = """
import sys
import torch
import zeroalloc.torch as zt

stage = int(sys.argv[1])
offload = sys.argv[2] == "offload"
if offload:
    zt.install()


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 16)).cuda()


plain, parted = build(), build()
plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
parted_optimizer = torch.optim.AdamW(parted.parameters(), lr=1e-2)
if offload:  # small windows: several per step
    zt.offload(parted, parted_optimizer, window_bytes=1 << 20)
handle = zt.partition(parted_optimizer, stage=stage, timeout_s=60,
                      model=parted if stage == 3 else None)
data = torch.Generator(device="cuda").manual_seed(1)
for step in range(4):
    x = torch.randn(64, 256, device="cuda", generator=data)
    y = torch.randn(64, 16, device="cuda", generator=data)
    losses = []
    for model, optimizer in ((plain, plain_optimizer), (parted, parted_optimizer)):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), parted.parameters()))
    print(f"stage {stage} step {step} loss {losses[0] == losses[1]} same {same}", flush=True)
    if offload:
        tensors = list(parted.parameters()) + [
            value for state in parted_optimizer.state.values() for value in state.values()
            if torch.is_tensor(value) and value.dim() > 0]
        for tensor in tensors:
            zt.offload_tensor(tensor)
        assert all(zt.residency(t) == "host" for t in tensors), [zt.residency(t) for t in tensors]
torch.cuda.synchronize()
"""


@pytest.mark.parametrize("stage,offload", [(1, "plain"), (2, "plain"), (3, "plain"),
                                           (1, "offload"), (2, "offload")])
def test_a_partitioned_model_on_the_gpu_trains_as_the_unpartitioned_one(tmp_path, stage,
                                                                      offload):
    script = tmp_path / "zero_gpu.py"
    script.write_text(textwrap.dedent(PROGRAM))
    env = {**os.environ, "PYTHONPATH": str(PACKAGE), "ZEROALLOC_LIBRARY": str(LIBRARY)}
    env.pop("ZEROALLOC_DEVICE", None)
    if offload == "offload":
        env["ZEROALLOC_OFFLOAD"] = "host"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                          str(script), str(stage), offload],
                         env=env, capture_output=True, text=True, timeout=240)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    for step in range(4):
        assert f"stage {stage} step {step} loss True same True" in output, output[-3000:]
