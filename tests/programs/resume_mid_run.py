"""Resume from a checkpoint mid-run: two steps, save, two more; then a new model and
optimizer loaded from the checkpoint train the same two steps again."""
import os
import tempfile

import torch
from _common import batches, emit, llama

data = batches(4)


def train(model, optimizer, part):
    losses = []
    for tokens in part:
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


model = llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
emit("first", *train(model, optimizer, data[:2]))
path = os.path.join(tempfile.mkdtemp(), "resume.pt")
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
emit("second", *train(model, optimizer, data[2:]))
del model, optimizer
again = llama(seed=3)
optimizer = torch.optim.AdamW(again.parameters(), lr=1e-3)
saved = torch.load(path, map_location="cuda")
again.load_state_dict(saved["model"])
optimizer.load_state_dict(saved["optimizer"])
emit("resumed", *train(again, optimizer, data[2:]))
