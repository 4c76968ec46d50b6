"""generate() after training: greedy decoding of 16 tokens."""
import torch
from _common import batches, emit, llama

model = llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for tokens in batches(3):
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
model.eval()
prompt = batches(1, batch=2, length=8, seed=4)[0]
out = model.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
emit("tokens", out.tolist())
