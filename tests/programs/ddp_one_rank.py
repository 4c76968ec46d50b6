"""DistributedDataParallel on one rank (NCCL on the GPU, gloo on the CPU)."""
import socket

import torch
import torch.distributed as dist
from _common import DEVICE, batches, emit, llama

with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo",
                        init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(llama())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, tokens in enumerate(batches(3)):
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
dist.destroy_process_group()
