"""DistributedDataParallel on one rank (NCCL on the GPU, gloo on the CPU)."""
import torch
import torch.distributed as dist
from _common import batches, emit, llama, one_rank_group

one_rank_group()
model = torch.nn.parallel.DistributedDataParallel(llama())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, tokens in enumerate(batches(3)):
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
dist.destroy_process_group()
