"""A DataLoader with two worker processes and pinned memory, batches copied non-blocking."""
import torch
from _common import DEVICE, VOCAB, emit, llama


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        return torch.randint(0, VOCAB, (128,), generator=torch.Generator().manual_seed(index))


data = torch.utils.data.DataLoader(Tokens(), batch_size=4, num_workers=2,
                                   pin_memory=DEVICE == "cuda")
model = llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, tokens in enumerate(data):
    tokens = tokens.to(DEVICE, non_blocking=True)
    loss = model(tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    emit(f"step{step}", loss.item())
