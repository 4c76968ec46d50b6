"""A frozen model with LoRA-style adapters on its attention projections; only the adapters
train. Tied embeddings."""
import torch
from _common import batches, emit, llama


class Adapted(torch.nn.Module):
    def __init__(self, base, rank=8):
        super().__init__()
        self.base = base
        self.down = torch.nn.Linear(base.in_features, rank, bias=False, device="cuda")
        self.up = torch.nn.Linear(rank, base.out_features, bias=False, device="cuda")
        torch.nn.init.zeros_(self.up.weight)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


model = llama(tie=True).requires_grad_(False)
for layer in model.model.layers:
    layer.self_attn.q_proj = Adapted(layer.self_attn.q_proj)
    layer.self_attn.v_proj = Adapted(layer.self_attn.v_proj)
trained = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(trained, lr=1e-2)
for step, tokens in enumerate(batches(4)):
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
emit("tied", model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr())
