"""FSDP2 on one rank: fully_shard on each decoder layer and on the model, three steps."""
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from _common import batches, emit, llama, one_rank_group

one_rank_group()
model = llama()
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, tokens in enumerate(batches(3)):
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
dist.destroy_process_group()
