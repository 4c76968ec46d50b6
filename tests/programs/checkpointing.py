"""Gradient checkpointing through transformers, non-reentrant then reentrant."""
import torch
from _common import batches, emit, llama

for reentrant in (False, True):
    model = llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, tokens in enumerate(batches(3)):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        emit(f"reentrant={reentrant} step{step}", loss.item())
