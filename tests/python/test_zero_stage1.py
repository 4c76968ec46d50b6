"""ZeRO stage 1 (zt.partition) under torchrun on the simulated device: each rank steps only
the parameters it owns and holds only their optimizer states, and after every step the
model is bit for bit the one an unpartitioned optimizer makes from the same gradients
(DistributedDataParallel's, over gloo); ranks whose optimizers differ end at the join, each
naming both settings."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "bindings" / "python"
LIBRARY = Path(os.environ.get("ZEROALLOC_LIBRARY", ROOT / "build" / "libzeroalloc.so"))
if not LIBRARY.exists():
    pytest.skip(f"skipped: {LIBRARY} is not built", allow_module_level=True)
pytest.importorskip("torch.distributed.run", reason="skipped: PyTorch (torchrun) is not installed")

sys.path.insert(0, str(ROOT / "tests" / "python"))
from test_group import installed_site, run_ranks, unmodified_under_torchrun  # noqa: E402

PROGRAM = """
import copy
import sys
import torch
import torch.distributed as dist
import zeroalloc.torch as zt

dist.init_process_group("gloo")
rank = dist.get_rank()


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 48), torch.nn.ReLU(),
                               torch.nn.Linear(48, 8))


plain = torch.nn.parallel.DistributedDataParallel(build())
parted = torch.nn.parallel.DistributedDataParallel(build())
plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
stepped = list(parted.parameters())
if {leave_one_out} and rank == 1:  # this rank's optimizer leaves the last bias to the script
    stepped = stepped[:-1]
parted_optimizer = torch.optim.AdamW(stepped, lr=1e-2)
try:
    handle = zt.partition(parted_optimizer, stage=1, timeout_s=30)
except zt.ZeroallocError as failure:
    print(f"rank {{rank}} partition failed: {{failure}}", flush=True)
    sys.exit(3)
inputs = torch.Generator().manual_seed(100 + rank)  # each rank its own data


def step_both() -> bool:  # one step of both on one batch: are they the same after it?
    x, y = torch.randn(16, 32, generator=inputs), torch.randn(16, 8, generator=inputs)
    for model, optimizer in ((plain, plain_optimizer), (parted, parted_optimizer)):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return all(torch.equal(a, b) for a, b in zip(plain.parameters(), parted.parameters()))


for step in range(4):
    print(f"rank {{rank}} step {{step}} same {{step_both()}}", flush=True)
# Note [Checkpoints of a partition]: the gathered state is the unpartitioned optimizer's.
gathered, whole = parted_optimizer.state_dict(), plain_optimizer.state_dict()
same_state = (gathered["param_groups"] == whole["param_groups"]
              and sorted(gathered["state"]) == sorted(whole["state"])
              and all(torch.equal(torch.as_tensor(gathered["state"][i][name]).cpu(),
                                  torch.as_tensor(whole["state"][i][name]).cpu())
                      for i in whole["state"] for name in whole["state"][i]))
print(f"rank {{rank}} gathered state same {{same_state}}", flush=True)
# Rank 0 alone: the same state there, nothing elsewhere.
at_rank0 = parted_optimizer.state_dict(rank0_only=True)
if rank:
    rank0_only = at_rank0 == {{}}
else:
    rank0_only = (sorted(at_rank0["state"]) == sorted(gathered["state"])
                  and all(torch.equal(torch.as_tensor(at_rank0["state"][i][name]),
                                      torch.as_tensor(gathered["state"][i][name]))
                          for i in gathered["state"] for name in gathered["state"][i]))
print(f"rank {{rank}} rank0 only {{rank0_only}}", flush=True)
owned_before = len(parted_optimizer.state)
# What a restart from the checkpoint does (a copy: the plain optimizer's state_dict holds
# its own tensors, which the loaded optimizer would then share).
parted_optimizer.load_state_dict(copy.deepcopy(whole))
print(f"rank {{rank}} loaded keeps {{len(parted_optimizer.state) == owned_before}}", flush=True)
print(f"rank {{rank}} after loading same {{step_both()}}", flush=True)
total = len(list(parted.parameters()))
print(f"rank {{rank}} states {{len(parted_optimizer.state)}} of {{total}} "
      f"owned {{handle.figures['owned_parameters']}} bytes {{handle.figures['owned_bytes']}} "
      f"of {{handle.figures['parameter_bytes']}}", flush=True)
"""


def torchrun(tmp_path, leave_one_out: bool = False) -> subprocess.CompletedProcess:
    script = tmp_path / "stage1.py"
    script.write_text(textwrap.dedent(PROGRAM.format(leave_one_out=leave_one_out)))
    return run_ranks(script, ZEROALLOC_REPORT=str(tmp_path / "run"))


def test_each_rank_steps_its_share_and_the_model_matches_an_unpartitioned_step(tmp_path):
    run = torchrun(tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    for rank in (0, 1):
        for step in range(4):
            assert f"rank {rank} step {step} same True" in output, output[-3000:]
        for what in ("gathered state same True", "rank0 only True", "loaded keeps True",
                     "after loading same True"):
            assert f"rank {rank} {what}" in output, output[-3000:]
    states, owned_bytes = {}, {}
    # The ranks' lines can run together in the one pipe: found by pattern, not by line.
    for found in re.finditer(r"rank (\d) states (\d+) of (\d+) owned (\d+) bytes (\d+) "
                             r"of (\d+)", run.stdout):
        rank, held, total, owned, mine, parameter_bytes = map(int, found.groups())
        states[rank], owned_bytes[rank] = held, mine
        assert held == owned, found.group(0)  # states only for what it owns
    assert sorted(states) == [0, 1], run.stdout
    assert states[0] + states[1] == total and 0 < states[0] < total, run.stdout
    assert owned_bytes[0] + owned_bytes[1] == parameter_bytes
    for rank in (0, 1):  # each rank's report says what it owned and sent
        zero = json.loads((tmp_path / f"run.rank{rank}.json").read_text())["sections"]["zero"]
        assert zero["stage"] == 1 and zero["rank"] == rank and zero["steps"] == 5, zero
        assert zero["owned_bytes"] == owned_bytes[rank], zero
        assert zero["broadcast_bytes"] == 5 * parameter_bytes, zero
        assert zero["broadcasts"] == 5 * 2, zero  # one bucket per owner a step, not 6
    # Whole parameters: each rank's share within the largest parameter of half the bytes.
    assert abs(owned_bytes[0] - owned_bytes[1]) <= 64 * 48 * 4, run.stdout


def test_ranks_whose_optimizers_differ_end_at_the_join_naming_both(tmp_path):
    run = torchrun(tmp_path, leave_one_out=True)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-3000:]
    assert "rank 0 partition failed" in output and "rank 1 partition failed" in output, \
        output[-3000:]
    assert "parameters=6" in output and "parameters=5" in output, output[-3000:]


UNMODIFIED = """
import hashlib
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
inputs = torch.Generator().manual_seed(100 + rank)
for step in range(3):
    x, y = torch.randn(16, 32, generator=inputs), torch.randn(16, 8, generator=inputs)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
# The model's state_dict: at stage 3 the parameters gathered from their owners.
whole = model.state_dict()
flat = torch.cat([whole[key].reshape(-1) for key in sorted(whole)]).view(torch.uint8)
digest = hashlib.sha256(bytes(flat.tolist()))  # (no NumPy needed)
grads = sum(p.grad is not None for p in model.parameters())
print(f"rank {rank} states {len(optimizer.state)} grads {grads} digest {digest.hexdigest()}",
      flush=True)
dist.destroy_process_group()
"""


def test_the_environment_alone_partitions_an_unmodified_script(tmp_path):
    """ZEROALLOC_ZERO_STAGE=1, 2 or 3 with the package installed: a script that never
    imports zeroalloc (and wraps its model in DistributedDataParallel) holds 1/N of its
    optimizer states per rank, at stages 2 and 3 also 1/N of its gradients, and ends with
    the same model, bit for bit, as without the variable."""
    site = installed_site(tmp_path)
    (tmp_path / "train.py").write_text(textwrap.dedent(UNMODIFIED))
    results = {}
    for stage in ("0", "1", "2", "3"):
        run = unmodified_under_torchrun(tmp_path, site, tmp_path / "train.py",
                                        ZEROALLOC_DEVICE="sim", ZEROALLOC_ZERO_STAGE=stage)
        # (rank, states, grads, digest); the ranks' lines can run together in the one pipe
        results[stage] = sorted(re.findall(
            r"rank (\d) states (\d+) grads (\d+) digest ([0-9a-f]{64})", run.stdout))
        assert len(results[stage]) == 2, run.stdout
    assert [int(states) for _, states, _, _ in results["0"]] == [4, 4], results
    for stage in ("1", "2", "3"):
        assert sorted(int(states) for _, states, _, _ in results[stage]) == [1, 3], results
    # Gradients: every rank all of them, except at stages 2 and 3 (each its own).
    for stage, expected in (("0", [4, 4]), ("1", [4, 4]), ("2", [1, 3]), ("3", [1, 3])):
        assert sorted(int(grads) for _, _, grads, _ in results[stage]) == expected, results
    digests = {digest for stage in results for _, _, _, digest in results[stage]}
    assert len(digests) == 1, f"the models differ: {results}"
