"""Schedulers: OneCycleLR on SGD, then ReduceLROnPlateau fed the loss."""
import torch
from _common import batches, emit, llama

model = llama()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
cycle = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=3)
plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
for step, tokens in enumerate(batches(6)):
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if step < 2:
        cycle.step()
    else:
        plateau.step(loss.item())
    emit(f"step{step}", loss.item(), optimizer.param_groups[0]["lr"])
