"""A checkpoint read back every way torch.load allows: map_location as a string, a device, a
dict and a function, weights_only, and mmap; each loaded into a fresh model and compared with
the trained one."""
import os
import tempfile

import torch
from _common import DEVICE, batches, emit, llama, model_digest

model = llama()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for tokens in batches(2):
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
path = os.path.join(tempfile.mkdtemp(), "model.pt")
torch.save(model.state_dict(), path)
emit("trained", model_digest(model))
where = f"{DEVICE}:0" if DEVICE == "cuda" else "cpu"
ways = {
    "string": dict(map_location=DEVICE),
    "device": dict(map_location=torch.device(where)),
    "dict": dict(map_location={where: "cpu"}),
    "function": dict(map_location=lambda storage, location: storage),
    "weights only": dict(map_location="cpu", weights_only=True),
    "mmap": dict(map_location="cpu", mmap=True),
}
for name, arguments in ways.items():
    state = torch.load(path, **arguments)
    emit(f"{name} devices", sorted({str(v.device) for v in state.values()}))
    fresh = llama(seed=7)
    fresh.load_state_dict(state)
    emit(f"{name} loaded", model_digest(fresh))
    tokens = batches(1, seed=3)[0]
    with torch.no_grad():
        emit(f"{name} evaluates", fresh(tokens, labels=tokens).loss.item())
    del fresh, state
