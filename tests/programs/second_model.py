"""A second model, of the same size, built and trained after the first is deleted: the
first one's memory must be free again."""
import gc

import torch
from _common import batches, emit, llama, model_digest

for round in range(2):
    model = llama(seed=round)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, tokens in enumerate(batches(2, seed=round)):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        emit(f"model{round} step{step}", loss.item())
    emit(f"model{round}", model_digest(model))
    del model, optimizer
    gc.collect()
