"""A checkpoint saved and read back: state_dict()'s devices and dtypes, torch.save, and
torch.load with map_location "cuda" and "cpu", compared with the live weights."""
import os
import tempfile

import torch
from _common import batches, emit, llama

model = llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for tokens in batches(3):
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
state = model.state_dict()
emit("devices", sorted({str(v.device) for v in state.values()}))
emit("dtypes", sorted({str(v.dtype) for v in state.values()}))
emit("optimizer devices", sorted({str(v.device) for s in optimizer.state_dict()["state"].values()
                                  for v in s.values() if torch.is_tensor(v) and v.dim() > 0}))
path = os.path.join(tempfile.mkdtemp(), "checkpoint.pt")
torch.save({"model": state, "optimizer": optimizer.state_dict()}, path)
on_gpu = torch.load(path, map_location="cuda")
on_cpu = torch.load(path, map_location="cpu")
emit("equal on cuda", all(torch.equal(on_gpu["model"][k], v) for k, v in model.state_dict().items()))
emit("equal on cpu", all(torch.equal(on_cpu["model"][k], v.cpu())
                         for k, v in model.state_dict().items()))
fresh = llama(seed=5)
fresh.load_state_dict(on_gpu["model"])
emit("loaded equal", all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters())))
