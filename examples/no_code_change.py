"""An ordinary training script: no line of it names zeroalloc.

    ZEROALLOC_OFFLOAD=host ZEROALLOC_MEMORY_LIMIT=1536MiB python examples/no_code_change.py

With the package installed, its start-up hook makes zeroalloc PyTorch's allocator when
the script imports torch, adopts the optimizer's parameters and states as it is created,
and hints each module's use. The same script runs natively without the variables, with
the same losses. Needs a CUDA GPU.
"""
import torch

torch.manual_seed(0)
width, layers = 4096, 8
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width),
                                                  torch.nn.GELU()) for _ in range(layers)])
model = model.cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
ema = [p.detach().clone() for p in model.parameters()]  # an EMA of the weights, read anywhere

for step in range(6):
    x = torch.randn(64, width, device="cuda")
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for average, p in zip(ema, model.parameters()):
            average.lerp_(p, 0.1)
    print(f"step {step}: loss {loss.item():.6f}")
print(f"ema norm {torch.stack([a.norm() for a in ema]).norm().item():.6f}")
