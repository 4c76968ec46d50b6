"""Mixed precision in fp16 with GradScaler."""
import torch
from _common import batches, emit, llama

model = llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cuda")
for step, tokens in enumerate(batches(4)):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(tokens, labels=tokens).loss
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item(), scaler.get_scale())
