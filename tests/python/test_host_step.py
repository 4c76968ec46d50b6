"""The host step on the GPU (ZEROALLOC_HOST_STEP; Note [Stepped on the host] in
lib/tier/host_step.hpp, Note [Host windows] in zeroalloc/torch/_host_step.py): a model
trained through zt.offload under a limit that its parameters, gradients and states do not
fit steps the windows whose states and parameters are on the host there, on the CPUs, and
its losses and final parameters stay within fp32 rounding of plain training on the device.

    python3 -m pytest -s tests/python/test_host_step.py
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

# Twelve layers of 16 MiB: 192 MiB of parameters, as much of gradients, twice as much of
# AdamW states: 768 MiB, under a limit of 448 MiB.
TRAIN = r"""
import os, sys, torch
import zeroalloc, zeroalloc.torch as zt
zt.install()
offload = os.environ.get("ZEROALLOC_OFFLOAD") == "host"
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)]).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
if offload:
    zt.offload(model, optimizer, hint_group_bytes=16 << 20, window_bytes=64 << 20,
               overlap_bytes=0)
data = [(torch.randn(256, 2048, device="cuda"), torch.randn(256, 2048, device="cuda"))
        for _ in range(8)]
losses = []
for x, y in data:
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item())
print("losses", " ".join(f"{value!r}" for value in losses))
if offload:
    print("figures", zt.step_figures(optimizer))
with torch.no_grad():
    values = {}
    for name, p in model.named_parameters():
        with zt.using(p):
            values[name] = p.detach().to("cpu")
torch.save(values, sys.argv[1])
"""


def run(tmp_path, name: str, **settings) -> str:
    env = {key: value for key, value in os.environ.items() if not key.startswith("ZEROALLOC_")}
    env.update({"ZEROALLOC_DEVICE": "cuda", "ZEROALLOC_LIBRARY": str(LIBRARY),
                "PYTHONPATH": str(PACKAGE), "ZEROALLOC_CHUNK_SIZE": "16MiB", **settings})
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(TRAIN),
                             str(tmp_path / f"{name}.pt")], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    return result.stdout


def field(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(name + " "))[len(name) + 1:]


def test_windows_on_the_host_step_there_within_rounding_of_the_device(tmp_path):
    plain = run(tmp_path, "plain")
    hosted = run(tmp_path, "hosted", ZEROALLOC_OFFLOAD="host", ZEROALLOC_HOST_LIMIT="4GiB",
                 ZEROALLOC_MEMORY_LIMIT="448MiB", ZEROALLOC_HOST_STEP="1")
    figures = eval(field(hosted, "figures"))  # a dict of numbers, printed by the run
    print("host step figures:", figures)
    assert figures["host_windows"] > 0, hosted
    expected = [float(v) for v in field(plain, "losses").split()]
    got = [float(v) for v in field(hosted, "losses").split()]
    worst_loss = max(abs(a - b) / abs(a) for a, b in zip(expected, got))
    reference = torch.load(tmp_path / "plain.pt")
    stepped = torch.load(tmp_path / "hosted.pt")
    worst = max(((stepped[name] - value).abs().max() / value.abs().max()).item()
                for name, value in reference.items())
    print(f"worst relative loss difference {worst_loss:.2e}; worst parameter difference "
          f"{worst:.2e} of the tensor's largest value")
    assert worst_loss < 1e-4, (expected, got)
    assert worst < 1e-4
