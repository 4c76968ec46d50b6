"""Dropout in training, switched off for an evaluation every other step, with the random
generator seeded before each step."""
import torch
from _common import batches, emit, llama

model = llama(attention_dropout=0.1)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
held_out = batches(1, seed=9)[0]
for step, tokens in enumerate(batches(4)):
    model.train()
    torch.manual_seed(100 + step)
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
    if step % 2 == 1:
        model.eval()
        with torch.no_grad():
            emit(f"eval{step}", model(held_out, labels=held_out).loss.item())
