"""torch.compile(model, mode="reduce-overhead"): CUDA graphs on the GPU."""
import torch
from _common import batches, emit, llama

model = llama()
compiled = torch.compile(model, mode="reduce-overhead")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, tokens in enumerate(batches(4)):
    loss = compiled(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
