"""A checkpoint loaded onto the device under a tight limit, with no line of the script changed
(ZEROALLOC_OFFLOAD=host and the package's start-up hook): the script trains, saves its model
and optimizer, then loads them back with torch.load(..., map_location="cuda") and goes on
training. The loaded copy is memory of class other that nothing uses until load_state_dict;
under a limit where the model, its states and that copy do not fit together, it moves to the
host as the last resort instead of failing the load (Note [Idle memory of any class]), and
the restored weights are exactly those saved.

    python3 -m pytest -s tests/python/test_checkpoint_under_limit.py
"""

import json
import os
import shutil
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

# 14 layers of 2048 x 2048: 58.8M parameters, 235 MB of weights, 470 MB of AdamW states, and a
# checkpoint of 705 MB. Under 880 MiB the weights and the loaded checkpoint (940 MB) do not
# fit together: after the states have gone to the host, part of the checkpoint must too.
LIMIT = 880 << 20
SCRIPT = textwrap.dedent("""
    import json, sys, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[layer for _ in range(14)
                                  for layer in (torch.nn.Linear(2048, 2048), torch.nn.GELU())])
    model = model.cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randn(64, 2048, device="cuda")

    def step():
        loss = model(inputs).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    losses = [step() for _ in range(3)]
    path = sys.argv[2]
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    saved = {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}
    loaded = torch.load(path, map_location="cuda")
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    del loaded
    restored = all(torch.equal(value.detach().cpu(), saved[name])
                   for name, value in model.state_dict().items())
    losses.append(step())
    import zeroalloc
    print("result " + json.dumps({"losses": losses, "restored": restored,
                                  "stats": zeroalloc.raw_stats(0)}))
""")


def run(tmp_path, **environment) -> subprocess.CompletedProcess:
    """SCRIPT in a fresh Python with the package's start-up hook on its path and only the
    ZEROALLOC_* variables given."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ZEROALLOC_")}
    env.pop("PYTHONPATH", None)
    env.update(environment)
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(PACKAGE / "zeroalloc-startup.pth", site)
    shutil.copytree(PACKAGE / "zeroalloc", site / "zeroalloc",
                    ignore=shutil.ignore_patterns("__pycache__"))
    program = "import site, sys; site.addsitedir(sys.argv[1]); exec(compile(sys.argv[3], 'x', 'exec'))"
    return subprocess.run([sys.executable, "-c", program, str(site), str(tmp_path / "ckpt.pt"),
                           SCRIPT], env=env, capture_output=True, text=True, timeout=600)


def test_a_checkpoint_loaded_onto_the_device_at_the_limit_moves_instead_of_failing(tmp_path):
    result = run(tmp_path, LD_PRELOAD=str(LIBRARY), ZEROALLOC_OFFLOAD="host",
                 ZEROALLOC_HOST_LIMIT="8GiB", ZEROALLOC_DEVICE="cuda",
                 ZEROALLOC_MEMORY_LIMIT=str(LIMIT))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    line = [line for line in result.stdout.splitlines() if line.startswith("result ")][-1]
    figures = json.loads(line[len("result "):])
    stats = figures["stats"]
    moved = stats["offload"]
    print(f"checkpoint reloaded under {LIMIT >> 20} MiB: {moved['bytes_to_host'] / 2**20:.0f} MiB "
          f"to the host, {moved['bytes_to_device'] / 2**20:.0f} MiB back; device holds "
          f"{stats['held_bytes'] / 2**20:.0f} MiB; losses {figures['losses']}")
    assert stats["limit_bytes"] == LIMIT  # the limit was in force
    assert stats["held_bytes"] <= LIMIT  # device memory (reserved counts host-backed chunks too)
    assert figures["restored"], "the weights loaded back differ from those saved"
    assert all(loss == loss and abs(loss) < 1e6 for loss in figures["losses"])
    # The model's states alone (470 MB) leave room for the checkpoint only with part of it
    # on the host: something beyond the states moved.
    assert moved["bytes_to_host"] > 470e6
