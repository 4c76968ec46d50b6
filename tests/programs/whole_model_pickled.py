"""torch.save of the whole module (pickled) and torch.load(weights_only=False) back onto the
device; the copy trains on from there."""
import os
import tempfile

import torch
from _common import DEVICE, batches, emit, llama, model_digest

model = llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = batches(4)
for tokens in data[:2]:
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
path = os.path.join(tempfile.mkdtemp(), "model.pt")
torch.save(model, path)
copy = torch.load(path, map_location=DEVICE, weights_only=False)
emit("same", model_digest(copy) == model_digest(model))
optimizer = torch.optim.AdamW(copy.parameters(), lr=1e-3)
for step, tokens in enumerate(data[2:]):
    loss = copy(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
