"""Parameters replaced and added during training: a layer's projection replaced by a new
Parameter, and a new module's parameters added to the optimizer with add_param_group."""
import torch
from _common import DEVICE, batches, emit, llama

model = llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = batches(6)
extra = None
for step, tokens in enumerate(data):
    if step == 2:
        with torch.no_grad():
            old = model.model.layers[0].mlp.down_proj.weight
            model.model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(old * 0.5)
        optimizer.add_param_group({"params": [model.model.layers[0].mlp.down_proj.weight]})
    if step == 4:
        torch.manual_seed(7)
        extra = torch.nn.Linear(512, 512, device=DEVICE)
        optimizer.add_param_group({"params": list(extra.parameters()), "lr": 5e-4})
    hidden = model.model(tokens).last_hidden_state
    if extra is not None:
        hidden = hidden + extra(hidden)
    logits = model.lm_head(hidden).float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
