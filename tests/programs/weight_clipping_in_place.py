"""Weights clipped in place after every step, and each parameter's gradient norm read
before the step (a log of per-parameter statistics)."""
import torch
from _common import batches, emit, llama

model = llama()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step, tokens in enumerate(batches(4)):
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    norms = [p.grad.norm().item() for p in model.parameters()]
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.05, 0.05)
    emit(f"step{step}", loss.item(), max(norms), sum(norms))
