"""ZeRO with no code change: a DistributedDataParallel script run under torchrun.

    ZEROALLOC_ZERO_STAGE=2 torchrun --nproc-per-node 2 examples/zero_torchrun.py

With the package installed, each rank then holds the optimizer states (and, at stage 2,
the gradients) of its own share of the parameters. It runs on GPUs over NCCL, or on the
CPU over gloo (the rank's states then live in CPU memory: the partitioning is the same).
Each rank prints how many parameters it holds states for, and the model's checksum, which
is the same on every rank and the same as without the variable.
"""
import torch
import torch.distributed as dist

backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend)
rank = dist.get_rank()
device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
if backend == "nccl":
    torch.cuda.set_device(device)

torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 16)).to(device))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(100 + rank)
for step in range(5):
    x = torch.randn(32, 64, generator=data).to(device)
    y = torch.randn(32, 16, generator=data).to(device)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()

checksum = sum(p.double().sum().item() for p in model.parameters())
print(f"rank {rank}: states for {len(optimizer.state)} of 4 parameters, "
      f"checksum {checksum:.12f}", flush=True)
dist.destroy_process_group()
