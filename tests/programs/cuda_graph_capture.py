"""Inference through a captured CUDA graph, as PyTorch's documentation shows it: a static
input, a few warm-up forwards on a side stream, torch.cuda.graph around one forward, then
each batch copied into the static input and the graph replayed. Tensors made between
replays must keep their values: the graph's memory is its own."""
import torch
from _common import DEVICE, batches, emit, llama

model = llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = batches(6)
for tokens in data[:2]:  # trained a little first, eagerly
    model(tokens, labels=tokens).loss.backward()
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
        static_logits = model(static_tokens).logits

    def forward(tokens):
        static_tokens.copy_(tokens)
        graph.replay()
        return static_logits
else:  # PROGRAMS_DEVICE=cpu checks the program's own logic: no graphs there
    def forward(tokens):
        with torch.no_grad():
            return model(tokens).logits

kept = []
for step, tokens in enumerate(data[2:]):
    logits = forward(tokens)
    emit(f"logits{step}", logits)
    kept.append(torch.full((1 << 16,), float(step), device=DEVICE))  # made between replays
for step, tensor in enumerate(kept):
    emit(f"kept{step}", tensor)
