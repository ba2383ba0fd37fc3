"""How many kernels inductor makes of a residual add and an RMSNorm-weighted
pack of x (forms of gemv.pack_x), compiled alone, under several options.

    PYTHONPATH=. python3 benchmarks/pack_fusion.py   # on a CUDA device

In the decode step, the pack with represented group sums was split (2026-11-30,
tenth session, benchmarks/RESULTS.md); alone, every form here compiled to one
kernel (measured with an inline copy of pack_x's formulas, before this script
used pack_x itself), so the split comes from the graph around it."""
import torch
from torch._inductor.utils import run_and_get_code

from brisklm.generate import OnePassReductions
from brisklm.kernels import gemv


def merged(res, partials, g):
    """The residual add and gemv.pack_x as the decode step runs them."""
    h = res + partials.sum(0).to(torch.bfloat16)
    return h, *gemv.pack_x(h, 128, g)


def represented(res, partials, g):
    """The same with each group's represented sum and flat planes (565.6 against 575.8 tok/s in the step)."""
    h, hi, lo, step, _, squares = merged(res, partials, g)
    x_sum = ((hi.float() + lo.float() * (1 / gemv.X_LO)) * step[:, None]).sum(1)
    return h, hi.reshape(-1), lo.reshape(-1), step, x_sum, squares


res = torch.randn(4096, device="cuda").bfloat16()
partials = torch.randn(4, 4096, device="cuda")
g = torch.rand(4096, device="cuda").bfloat16()
opts = {"plain": {}, "pdl": {"triton.enable_pdl": True},
        "choices": {"inductor_choices_class": OnePassReductions},
        "brisk": {"triton.cudagraphs": True, "triton.enable_pdl": True, "inductor_choices_class": OnePassReductions}}
for form, fn in (("represented sum, flat", represented), ("true sum, (G, 128)", merged)):
    for option, o in opts.items():
        torch._dynamo.reset()
        _, code = run_and_get_code(torch.compile(fn, options=o), res, partials, g)
        names = [line.split("def ")[1].split("(")[0] for line in "\n".join(code).splitlines()
                 if line.startswith("def triton_")]
        print(f"{form} {option}: {len(names)} kernels: {', '.join(names)}")
