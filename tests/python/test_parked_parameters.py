"""Parameters parked behind unmapped addresses (Note [Parameters parked] in
lib/tier/offload_engine.hpp), on the GPU: a model trained through zt.offload under a limit
that its parameters, gradients and states do not fit parks parameters it evicts, and still
computes the losses of plain training bit for bit; while parameters are parked,
model.state_dict() and torch.save give their values, as does a read inside zt.using.
Parking is an optimization of ZEROALLOC_ACCESS=hinted only, which these scripts set.

    python3 -m pytest -s tests/python/test_parked_parameters.py
"""

from gpu_script import field, require_gpu, run_script

torch = require_gpu()

# Twelve layers of 16 MiB: 192 MiB of parameters, as much of gradients, twice as much of
# AdamW states: 768 MiB, under a limit of 512 MiB.
TRAIN = r"""
import os, sys, torch
import zeroalloc, zeroalloc.torch as zt
zt.install()
offload = os.environ.get("ZEROALLOC_OFFLOAD") == "host"
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)]).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
if offload:
    # A hint per layer; windows of about four layers (the step's scratch fits the limit).
    zt.offload(model, optimizer, hint_group_bytes=16 << 20, window_bytes=64 << 20,
               overlap_bytes=32 << 20)
data = [(torch.randn(256, 2048, device="cuda"), torch.randn(256, 2048, device="cuda"))
        for _ in range(6)]
autocast = os.environ.get("TRAIN_AUTOCAST") == "1"
losses = []
for x, y in data:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    losses.append(loss.item())
print("losses", " ".join(f"{value!r}" for value in losses))
if offload:
    stats = zeroalloc.raw_stats(0)["offload"]
    print("parked", stats["chunks_parked"], "mapped", stats["chunks_unparked"])
    print("uses", stats["uses"], "to_device", stats["bytes_to_device"])
    if autocast:
        sys.exit(0)
    # Room taken by an allocation of class other: idle parameters leave, parked.
    room = torch.empty(360 << 20, dtype=torch.uint8, device="cuda")
    parked = [name for name, p in model.named_parameters() if zt.residency(p) == "host_unmapped"]
    print("parked now", len(parked))
    assert parked, [zt.residency(p) for p in model.parameters()]
    saved = model.state_dict()
    torch.save(saved, sys.argv[1])
    loaded = torch.load(sys.argv[1])
    for name, p in model.named_parameters():
        with zt.using(p):
            value = p.detach().to("cpu")
        assert torch.equal(loaded[name].cpu(), value), name
    print("state_dict ok", len(parked))
"""



def test_parked_parameters_train_bit_for_bit_and_save_their_values(tmp_path):
    plain = run_script(TRAIN, str(tmp_path / "model.pt"))
    paged = run_script(TRAIN, str(tmp_path / "model.pt"), ZEROALLOC_OFFLOAD="host",
                       ZEROALLOC_ACCESS="hinted",
                       ZEROALLOC_HOST_LIMIT="4GiB", ZEROALLOC_MEMORY_LIMIT="512MiB")
    assert field(paged, "losses") == field(plain, "losses")
    parked = field(paged, "parked").split()
    assert int(parked[0]) > 0, paged  # evictions during training parked parameters
    assert "state_dict ok" in paged
    print(field(paged, "parked"), "; parked when saved:", field(paged, "parked now"))


def test_under_autocast_weights_stay_parked_through_the_backward():
    """Note [The backward reads what autograd saved] (zeroalloc/torch/_backward_uses.py):
    under autocast each Linear saves the bf16 copy of its weight, so the backward brings
    back no fp32 weight (ZEROALLOC_BACKWARD_USES=saved, the default): the losses are plain
    training's bit for bit, parked weights stay parked (a read of one would fault), and the
    engine sees fewer uses and fetches fewer bytes than when every weight comes back
    (ZEROALLOC_BACKWARD_USES=all)."""
    settings = dict(ZEROALLOC_OFFLOAD="host", ZEROALLOC_ACCESS="hinted", ZEROALLOC_HOST_LIMIT="4GiB",
                    ZEROALLOC_MEMORY_LIMIT="512MiB", TRAIN_AUTOCAST="1")
    plain = run_script(TRAIN, "unused", TRAIN_AUTOCAST="1")
    saved = run_script(TRAIN, "unused", **settings)
    every = run_script(TRAIN, "unused", ZEROALLOC_BACKWARD_USES="all", **settings)
    assert field(saved, "losses") == field(plain, "losses")
    assert field(every, "losses") == field(plain, "losses")
    uses_saved, fetched_saved = (int(v) for v in field(saved, "uses").split()[::2])
    uses_every, fetched_every = (int(v) for v in field(every, "uses").split()[::2])
    assert int(field(saved, "parked").split()[0]) > 0, saved
    assert uses_saved < uses_every, (saved, every)
    assert fetched_saved < fetched_every, (saved, every)
    print(f"uses {uses_saved} against {uses_every}; fetched {fetched_saved >> 20} MiB against "
          f"{fetched_every >> 20} MiB")
