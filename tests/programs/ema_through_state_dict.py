"""An EMA helper as some libraries write one: it updates its copy through the tensors of
state_dict(), and the model is evaluated with the EMA's weights loaded into it."""
import copy

import torch
from _common import batches, emit, llama, model_digest

model = llama()
ema = copy.deepcopy(model.state_dict())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, tokens in enumerate(batches(4)):
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if value.is_floating_point():
                ema[key].mul_(0.8).add_(value, alpha=0.2)
    emit(f"step{step}", loss.item())
model.load_state_dict(ema)
held_out = batches(1, seed=9)[0]
with torch.no_grad():
    emit("eval with the ema", model(held_out, labels=held_out).loss.item())
emit("model", model_digest(model))
