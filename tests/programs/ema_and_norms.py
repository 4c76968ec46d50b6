"""Training with an EMA of the weights, the weights' norm logged each step, and an
evaluation under torch.no_grad() of both the model and its EMA."""
import copy

import torch
from _common import batches, emit, llama, model_digest

model = llama()
ema = copy.deepcopy(model).requires_grad_(False)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, tokens in enumerate(batches(4)):
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for mine, theirs in zip(ema.parameters(), model.parameters()):
            mine.mul_(0.9).add_(theirs, alpha=0.1)
        norm = torch.sqrt(sum(p.float().pow(2).sum() for p in model.parameters()))
    emit(f"step{step}", loss.item(), norm.item())
with torch.no_grad():
    held_out = batches(1, seed=9)[0]
    emit("eval", model(held_out, labels=held_out).loss.item(),
         ema(held_out, labels=held_out).loss.item())
emit("model", model_digest(model))
emit("ema", model_digest(ema))
