"""Gradient accumulation over two micro-batches and clip_grad_norm_, with a cosine LR
schedule."""
import torch
from _common import batches, emit, llama

model = llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=4)
data = batches(8)
for step in range(4):
    for tokens in data[2 * step:2 * step + 2]:
        (model(tokens, labels=tokens).loss / 2).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad()
    emit(f"step{step}", norm.item(), schedule.get_last_lr()[0])
