"""A gradient penalty: the gradient of the loss with respect to the input embeddings,
taken with create_graph=True, its norm added to the loss (a double backward)."""
import torch
from _common import batches, emit, llama

model = llama(layers=2)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, tokens in enumerate(batches(3)):
    embeds = model.model.embed_tokens(tokens).detach().requires_grad_(True)
    loss = model(inputs_embeds=embeds, labels=tokens).loss
    (grad,) = torch.autograd.grad(loss, embeds, create_graph=True)
    total = loss + 0.1 * grad.pow(2).sum()
    total.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item(), total.item())
