"""torch.compile(model) in its default mode: three training steps."""
import torch
from _common import batches, emit, llama

model = llama()
compiled = torch.compile(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, tokens in enumerate(batches(3)):
    loss = compiled(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
