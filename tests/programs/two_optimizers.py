"""Two optimizers over two parts of the model (SGD with momentum for the embeddings, AdamW
for the rest), an optimizer re-created mid-run, and a user hook on a gradient."""
import torch
from _common import batches, emit, llama

model = llama()
embeddings = list(model.model.embed_tokens.parameters())
rest = [p for n, p in model.named_parameters() if not n.startswith("model.embed_tokens")]
seen = []
rest[0].register_hook(lambda grad: seen.append(grad.norm().item()))
first = torch.optim.SGD(embeddings, lr=0.1, momentum=0.9)
second = torch.optim.AdamW(rest, lr=1e-3)
for step, tokens in enumerate(batches(4)):
    if step == 2:
        second = torch.optim.AdamW(rest, lr=5e-4)  # re-created: fresh states
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    first.step()
    second.step()
    first.zero_grad()
    second.zero_grad()
    emit(f"step{step}", loss.item(), seen[-1])
