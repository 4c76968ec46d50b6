"""ZeRO stages 1-3 on a GPU (zt.partition). One rank under torchrun: the collectives go through
NCCL on the CUDA tensors' streams, every parameter is the rank's own, so the reduces and
broadcasts run in place, and the model must train bit for bit as the same model without
partitioning does. Two ranks on the one GPU: the collectives go through rank 0 over TCP
(ZEROALLOC_COLLECTIVES=tcp), each rank owns half, and the model must train bit for bit as
the unpartitioned one stepped with both ranks' gradients combined as the reduce combines
them. Every stage also with offload (zt.offload before zt.partition): every parameter and
state of the partitioned model sent to the host after each step, so the next forward,
backward, step and gathers meet them there."""

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
import os
import sys
import torch
import zeroalloc.torch as zt

stage = int(sys.argv[1])
offload = sys.argv[2] == "offload"
rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
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
    # Every rank draws every rank's batch; each trains the partitioned model on its own.
    batches = [(torch.randn(64, 256, device="cuda", generator=data),
                torch.randn(64, 16, device="cuda", generator=data)) for _ in range(ranks)]
    # The unpartitioned model from every rank's gradients, combined as the partition's
    # reduce combines them: each divided by the number of ranks, summed in rank order.
    plain_losses, combined = [], None
    for x, y in batches:
        plain_optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(plain(x), y)
        loss.backward()
        plain_losses.append(loss.item())
        part = [p.grad * (1.0 / ranks) for p in plain.parameters()]
        combined = part if combined is None else [a + b for a, b in zip(combined, part)]
    for parameter, gradient in zip(plain.parameters(), combined):
        parameter.grad = gradient
    plain_optimizer.step()
    parted_optimizer.zero_grad()
    x, y = batches[rank]
    loss = torch.nn.functional.mse_loss(parted(x), y)
    loss.backward()
    parted_optimizer.step()
    # state_dict(): at stage 3 every parameter gathered from its owner (every rank calls it)
    mine = parted.state_dict()
    same = all(torch.equal(a.cpu(), mine[name].cpu()) for name, a in plain.state_dict().items())
    print(f"rank {rank} stage {stage} step {step} loss {loss.item() == plain_losses[rank]} "
          f"same {same}", flush=True)
    if offload:
        tensors = [p for p in parted.parameters() if p.numel() > 0] + [
            value for state in parted_optimizer.state.values() for value in state.values()
            if torch.is_tensor(value) and value.dim() > 0]
        for tensor in tensors:
            zt.offload_tensor(tensor)
        assert all(zt.residency(t) == "host" for t in tensors), [zt.residency(t) for t in tensors]
        # Read where they lie (parked parameters included): the gathers pin them.
        again = parted.state_dict()
        assert all(torch.equal(again[name].cpu(), a.cpu()) for name, a in mine.items())
torch.cuda.synchronize()
"""


@pytest.mark.parametrize("stage,offload,ranks", [
    (1, "plain", 1), (2, "plain", 1), (3, "plain", 1), (1, "offload", 1), (2, "offload", 1),
    (3, "offload", 1), (2, "plain", 2), (3, "plain", 2), (2, "offload", 2), (3, "offload", 2)])
def test_a_partitioned_model_on_the_gpu_trains_as_the_unpartitioned_one(tmp_path, stage,
                                                                      offload, ranks):
    """Two ranks share the one GPU through collectives over TCP (ZEROALLOC_COLLECTIVES=tcp;
    NCCL takes a GPU per rank): each trains on its own batch, and the partitioned model must
    be bit for bit the unpartitioned one stepped with every rank's gradients combined as the
    reduce combines them. At stage 3 under offload a rank's engine pages its own parameters
    alone (Note [Stage 3 under offload])."""
    script = tmp_path / "zero_gpu.py"
    script.write_text(textwrap.dedent(PROGRAM))
    env = {**os.environ, "PYTHONPATH": str(PACKAGE), "ZEROALLOC_LIBRARY": str(LIBRARY)}
    env.pop("ZEROALLOC_DEVICE", None)
    if offload == "offload":
        env["ZEROALLOC_OFFLOAD"] = "host"
        env["ZEROALLOC_HOST_LIMIT"] = "2GiB"  # each rank's pinned pool
    if ranks > 1:
        env["ZEROALLOC_COLLECTIVES"] = "tcp"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          str(ranks), "--master-addr", "127.0.0.1", "--master-port",
                          str(free_port()), str(script), str(stage), offload],
                         env=env, capture_output=True, text=True, timeout=240)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    for rank in range(ranks):
        for step in range(4):
            assert f"rank {rank} stage {stage} step {step} loss True same True" in output, \
                output[-3000:]


def test_a_second_rank_on_a_machine_with_one_gpu_names_the_setting_that_allows_it(tmp_path):
    """NCCL takes one GPU per rank: with one GPU, LOCAL_RANK 1 is refused at the join with a
    message naming ZEROALLOC_COLLECTIVES=tcp, and the job ends."""
    if torch.cuda.device_count() != 1:
        pytest.skip("skipped: the machine has more than one GPU")
    script = tmp_path / "zero_gpu.py"
    script.write_text(textwrap.dedent(PROGRAM))
    env = {**os.environ, "PYTHONPATH": str(PACKAGE), "ZEROALLOC_LIBRARY": str(LIBRARY)}
    env.pop("ZEROALLOC_DEVICE", None)
    env.pop("ZEROALLOC_COLLECTIVES", None)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--master-addr", "127.0.0.1", "--master-port",
                          str(free_port()), str(script), "1", "plain"],
                         env=env, capture_output=True, text=True, timeout=240)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-3000:]
    assert "LOCAL_RANK=1 on a machine with one GPU" in output, output[-3000:]
    assert "ZEROALLOC_COLLECTIVES=tcp" in output, output[-3000:]
