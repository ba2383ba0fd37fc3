"""How many kernels inductor makes of a residual add and an RMSNorm-weighted
pack of x (forms of gemv.pack_x), compiled alone, under several options.

    PYTHONPATH=. python3 benchmarks/pack_fusion.py   # on a CUDA device

In the decode step, the pack with represented group sums was split (2026-11-30,
tenth session, benchmarks/RESULTS.md); alone, every form here compiles to one
kernel, so the split comes from the graph around it."""
import torch
from torch._inductor.utils import run_and_get_code

X_LO = 254


def planes(v, represented_sum, flat):
    step = v.abs().amax(1, keepdim=True).clamp(min=1e-30) * (1 / 127)
    inv = 1 / step
    hi = torch.floor(v * inv + 0.5)
    lo = torch.floor((v - hi * step) * (X_LO * inv) + 0.5)
    x_sum = ((hi + lo * (1 / X_LO)) * step).sum(1) if represented_sum else v.sum(1)
    hi, lo = hi.to(torch.int8), lo.to(torch.int8)
    if flat:
        hi, lo = hi.reshape(-1), lo.reshape(-1)
    return hi, lo, step.reshape(-1), x_sum


def variant(represented_sum, flat, division=False):
    def f(res, partials, g):
        h = res + partials.sum(0).to(torch.bfloat16)
        xf = h.float().reshape(-1, 128)
        squares = xf.square().sum(1)
        v = xf * g.float().reshape(-1, 128)
        if division:
            step = v.abs().amax(1, keepdim=True).clamp(min=1e-30) * (1 / 127)
            hi = torch.round(v / step)
            lo = torch.round((v - hi * step) / step * X_LO)
            xs = v.sum(1)
            return h, hi.to(torch.int8), lo.to(torch.int8), step.reshape(-1), xs, squares
        return (h, *planes(v, represented_sum, flat), squares)
    return f


res = torch.randn(4096, device="cuda").bfloat16()
partials = torch.randn(4, 4096, device="cuda")
g = torch.rand(4096, device="cuda").bfloat16()
from brisklm.generate import OnePassReductions
opts = {"plain": {}, "pdl": {"triton.enable_pdl": True},
        "choices": {"inductor_choices_class": OnePassReductions},
        "brisk": {"triton.cudagraphs": True, "triton.enable_pdl": True, "inductor_choices_class": OnePassReductions}}
for name, fn, o in [(f"{a} {b}", fn, opts[b]) for a, fn in (("represented sum, flat", variant(True, True)),
                    ("true sum, (G, 128)", variant(False, False))) for b in opts]:
    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(fn, options=o), res, partials, g)
    src = "\n".join(code)
    names = [line.split("def ")[1].split("(")[0] for line in src.splitlines()
             if line.startswith("def triton_")]
    print(f"{name}: {len(names)} kernels: {', '.join(names)}")
