"""Training beyond GPU memory from PyTorch: a plain loop with two lines for zeroalloc.

    ZEROALLOC_OFFLOAD=host ZEROALLOC_MEMORY_LIMIT=1536MiB python examples/train_offload.py

The model (134M parameters), its gradients and AdamW's states need about 2.1 GiB; the limit
is 1.5 GiB. States and parameters not in use move to pinned host memory and come back
before they are needed. The loop prints the loss and, at the end, what moved. Needs a CUDA GPU.
"""
import torch

import zeroalloc
import zeroalloc.torch as zt

zt.install()  # first thing, before any CUDA work: zeroalloc becomes PyTorch's allocator

torch.manual_seed(0)
width, layers = 4096, 8
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width),
                                                  torch.nn.GELU()) for _ in range(layers)])
model = model.cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
zt.offload(model, optimizer)  # parameters and states in their own classes, hints on

for step in range(6):
    x = torch.randn(64, width, device="cuda")
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.6f}")

offload = zeroalloc.raw_stats()["offload"] or {}
moved = offload.get("bytes_to_host", 0) >> 20
hit_rate = offload.get("prefetch_hit_rate", 1.0)
print(f"moved to the host: {moved} MiB; prefetch hit rate {hit_rate:.2f}")
