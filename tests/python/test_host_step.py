"""The host step on the GPU (ZEROALLOC_HOST_STEP; Note [Stepped on the host] in
lib/tier/host_step.hpp, Note [Host windows] in zeroalloc/torch/_host_step.py): a model
trained through zt.offload under a limit that its parameters, gradients and states do not
fit steps the windows whose states and parameters are on the host there, on the CPUs, and
its losses and final parameters stay within fp32 rounding of plain training on the device.

    python3 -m pytest -s tests/python/test_host_step.py
"""

import ast

from gpu_script import field, require_gpu, run_script

torch = require_gpu()

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


def test_windows_on_the_host_step_there_within_rounding_of_the_device(tmp_path):
    plain = run_script(TRAIN, str(tmp_path / "plain.pt"))
    hosted = run_script(TRAIN, str(tmp_path / "hosted.pt"), ZEROALLOC_OFFLOAD="host",
                        ZEROALLOC_HOST_LIMIT="4GiB", ZEROALLOC_MEMORY_LIMIT="448MiB",
                        ZEROALLOC_HOST_STEP="1")
    figures = ast.literal_eval(field(hosted, "figures"))  # a dict printed by the run
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
