"""A loop through Accelerate: prepare(), accelerator.backward(), gradient clipping."""
import torch
from _common import DEVICE, VOCAB, emit, llama
from accelerate import Accelerator

accelerator = Accelerator(cpu=DEVICE == "cpu")
generator = torch.Generator().manual_seed(1)
data = torch.utils.data.DataLoader(torch.randint(0, VOCAB, (16, 128), generator=generator),
                                   batch_size=4)
model = llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for step, tokens in enumerate(data):
    loss = model(tokens, labels=tokens).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
