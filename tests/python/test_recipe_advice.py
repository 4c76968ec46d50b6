"""ZEROALLOC_RECIPE on the GPU (Note [The fast recipe, advised] in
zeroalloc/torch/_recipe_advice.py): a run that names no recipe, whose steps move memory, is
told once, in the log and the report, what the fast recipe would give it; a run that names
exact is not; fast trains with master weights and the host step.

    python3 -m pytest -s tests/python/test_recipe_advice.py
"""

import ast
import json

from gpu_script import field, require_gpu, run_script

torch = require_gpu()

# Twelve fp32 layers of 16 MiB with AdamW: 768 MiB of parameters, gradients and states
# under a limit of 448 MiB, so every step moves states. With the argument "autocast" the
# forward runs under bf16 autocast, as the fast recipe's bf16 weights need for fp32 inputs.
TRAIN = r"""
import contextlib, sys
import torch
import zeroalloc.torch as zt
zt.install()
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)]).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
zt.offload(model, optimizer, hint_group_bytes=16 << 20, window_bytes=64 << 20)
x, y = torch.randn(256, 2048, device="cuda"), torch.randn(256, 2048, device="cuda")
for _ in range(10):
    with (torch.autocast("cuda", torch.bfloat16) if sys.argv[1:] == ["autocast"]
          else contextlib.nullcontext()):
        loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print("figures", zt.step_figures(optimizer))
print("dtype", next(model.parameters()).dtype)
"""

LIMITS = {"ZEROALLOC_OFFLOAD": "host", "ZEROALLOC_MEMORY_LIMIT": "448MiB",
          "ZEROALLOC_HOST_LIMIT": "4GiB"}


def test_a_run_that_names_no_recipe_is_told_once_what_fast_would_give_it(tmp_path):
    log, report = tmp_path / "run.log", tmp_path / "run"
    out = run_script(TRAIN, "autocast", ZEROALLOC_LOG_FILE=str(log),
                     ZEROALLOC_REPORT=str(report), **LIMITS)
    figures = ast.literal_eval(field(out, "figures"))
    print("advice figures:", {k: v for k, v in figures.items() if k.startswith("recipe")})
    assert figures["recipe_advice"] == "advised", figures
    assert figures["recipe_advice_at_step"] >= 3  # after the two steps that settle
    told = [line for line in log.read_text().splitlines() if "ZEROALLOC_RECIPE=fast" in line]
    assert len(told) == 1, told
    # The message gives the figures the advice used.
    assert f"took {figures['recipe_advice_measured_s']:.2f} s" in told[0]
    assert f"about {figures['recipe_advice_predicted_s']:.2f} s" in told[0]
    section = json.loads(report.with_suffix(".json").read_text())["sections"]["recipe"]
    assert section["advised"] == "ZEROALLOC_RECIPE=fast"
    assert section["predicted_step_s"] == round(figures["recipe_advice_predicted_s"], 4)
    assert section["cpu_params_per_s"] > 1e8 and section["host_to_device_gbps"] > 1
    assert field(out, "dtype") == "torch.float32"  # the recipe itself did not change


def test_a_run_whose_forward_is_outside_autocast_is_not_told_to_switch(tmp_path):
    """Its fp32 inputs would meet the fast recipe's bf16 weights and fail."""
    log = tmp_path / "run.log"
    out = run_script(TRAIN, ZEROALLOC_LOG_FILE=str(log), **LIMITS)
    figures = ast.literal_eval(field(out, "figures"))
    assert figures["recipe_advice"] == "off", figures
    assert "ran outside CUDA autocast" in figures["recipe_advice_reason"], figures
    assert "ZEROALLOC_RECIPE=fast" not in log.read_text()


def test_a_run_that_names_exact_is_not_told_and_fast_trains_in_bf16_on_the_cpus(tmp_path):
    log = tmp_path / "exact.log"
    out = run_script(TRAIN, "autocast", ZEROALLOC_LOG_FILE=str(log), ZEROALLOC_RECIPE="exact",
                     **LIMITS)
    figures = ast.literal_eval(field(out, "figures"))
    assert figures["recipe_advice"] == "off"
    assert figures["recipe_advice_reason"] == "ZEROALLOC_RECIPE is set"
    assert "ZEROALLOC_RECIPE=fast" not in log.read_text()
    fast = run_script(TRAIN, "autocast", ZEROALLOC_RECIPE="fast", **LIMITS)
    figures = ast.literal_eval(field(fast, "figures"))
    assert field(fast, "dtype") == "torch.bfloat16"  # working copies of fp32 masters
    assert figures["host_windows"] > 0, figures  # the CPUs stepped the masters on the host
