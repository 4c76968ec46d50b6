"""The same model trained for two steps by each of several optimizers: SGD with Nesterov,
Adagrad, RMSprop, Adam with amsgrad, and AdamW with foreach off."""
import gc

import torch
from _common import batches, emit, llama, model_digest

makers = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
    "amsgrad": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True),
    "adamw_loop": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False),
}
for name, make in makers.items():
    model = llama()
    optimizer = make(model.parameters())
    for step, tokens in enumerate(batches(2)):
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        emit(f"{name} step{step}", loss.item())
    emit(name, model_digest(model))
    del model, optimizer
    gc.collect()
