"""A custom autograd.Function that keeps a weight on ctx (not save_for_backward) and reads
it in its backward; used on every decoder layer's output."""
import torch
from _common import DEVICE, batches, emit, llama


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.weight = weight
        ctx.save_for_backward(x)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * ctx.weight, (grad * x).sum(dim=(0, 1))


class Scaled(torch.nn.Module):
    def __init__(self, layer, width):
        super().__init__()
        self.layer = layer
        self.scale = torch.nn.Parameter(torch.ones(width, device=DEVICE))

    def forward(self, hidden, *args, **kwargs):
        out = self.layer(hidden, *args, **kwargs)
        if isinstance(out, tuple):
            return (Scale.apply(out[0], self.scale),) + out[1:]
        return Scale.apply(out, self.scale)


model = llama()
model.model.layers = torch.nn.ModuleList(Scaled(layer, 512) for layer in model.model.layers)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, tokens in enumerate(batches(3)):
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
