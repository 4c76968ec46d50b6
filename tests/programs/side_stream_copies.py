"""Batches copied from pinned memory on a side stream with non_blocking and record_stream,
the next batch in flight while the model trains on the current one."""
import torch
from _common import VOCAB, emit, llama

model = llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(1)
host = [torch.randint(0, VOCAB, (4, 128), generator=generator).pin_memory() for _ in range(4)]
side = torch.cuda.Stream()


def upload(batch):
    with torch.cuda.stream(side):
        on_device = batch.to("cuda", non_blocking=True)
    return on_device, side.record_event()


pending = upload(host[0])
for step in range(4):
    tokens, ready = pending
    torch.cuda.current_stream().wait_event(ready)
    tokens.record_stream(torch.cuda.current_stream())
    if step + 1 < len(host):
        pending = upload(host[step + 1])
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
