"""A model converted to bfloat16 and trained in bfloat16 (no autocast)."""
import torch
from _common import batches, emit, llama, model_digest

model = llama().to(torch.bfloat16)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, tokens in enumerate(batches(4)):
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
emit("model", model_digest(model))
