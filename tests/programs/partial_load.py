"""load_state_dict(strict=False) mid-run with the weights of some layers from another
model; the missing and unexpected keys reported as PyTorch reports them."""
import torch
from _common import batches, emit, llama

model = llama()
donor = llama(seed=11)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, tokens in enumerate(batches(4)):
    if step == 2:
        part = {k: v for k, v in donor.state_dict().items() if k.startswith("model.layers.1.")}
        part["not.a.key"] = torch.zeros(1)
        result = model.load_state_dict(part, strict=False)
        emit("missing", len(result.missing_keys), "unexpected", result.unexpected_keys)
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
