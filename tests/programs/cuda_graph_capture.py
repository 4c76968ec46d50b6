"""Inference through a captured CUDA graph, as PyTorch's documentation shows it: a static
input, a few warm-up forwards on a side stream, torch.cuda.graph around one forward, then
each batch copied into the static input and the graph replayed. Tensors made between
replays must keep their values: the graph's memory is its own.
The model is written by hand, as graph users write theirs: transformers' Llama makes a CPU
tensor in its mask, which a capture refuses even natively."""
import torch
from torch import nn
from _common import DEVICE, VOCAB, batches, emit


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, width * 4)
        self.down = nn.Linear(width * 4, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, width: int = 512, depth: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def loss_of(logits, tokens):
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


torch.manual_seed(0)
model = Model().to(DEVICE)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = batches(6)
for tokens in data[:2]:  # trained a little first, eagerly
    loss = loss_of(model(tokens), tokens)
    emit("loss", loss.item())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
model.eval()
static_tokens = data[2].clone()
if DEVICE == "cuda":
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static_tokens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_logits = model(static_tokens)

    def forward(tokens):
        static_tokens.copy_(tokens)
        graph.replay()
        return static_logits
else:  # PROGRAMS_DEVICE=cpu checks the program's own logic: no graphs there
    def forward(tokens):
        with torch.no_grad():
            return model(tokens)

kept = []
for step, tokens in enumerate(data[2:]):
    logits = forward(tokens)
    emit(f"logits{step}", logits)
    kept.append(torch.full((1 << 16,), float(step), device=DEVICE))  # made between replays
for step, tensor in enumerate(kept):
    emit(f"kept{step}", tensor)
