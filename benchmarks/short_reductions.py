"""The residual add and gemv.pack_x of the int4 decode step, compiled alone:
the kernel's time per call under inductor's own choice and under brisk's
compiler options (generate.OnePassReductions) with each fixed block of
reductions a program (generate.SHORT_REDUCTION_BLOCK, part of the options'
cache key), whose generated code must say so and whose outputs must equal
inductor's own compile.

    PYTHONPATH=.:benchmarks python3 benchmarks/short_reductions.py   # on a CUDA device

Inductor otherwise times up to three XBLOCKs at the first run and keeps the
fastest; in the decode step its pick for this kernel varied between compiles.
"""
import torch
from torch._inductor.utils import run_and_get_code

from brisklm import generate
from brisklm.generate import OnePassReductions
from brisklm.kernels import gemv
from gemv_sweep import time_us  # a CUDA graph of the calls, best of 3


def merged(res, partials, g, group):
    """The residual add and gemv.pack_x as the decode step runs them."""
    h = res + partials.sum(0).to(torch.bfloat16)
    return h, *gemv.pack_x(h, group, g)


def main():
    torch.manual_seed(0)
    print("| K, group | compiled with | us per call | fixed config in code | outputs as inductor's own |")
    print("| --- | --- | --- | --- | --- |")
    for k, group in ((4096, 128), (14336, 128)):
        args = (torch.randn(k, device="cuda").bfloat16(), torch.randn(4, k, device="cuda"),
                torch.rand(k, device="cuda").bfloat16(), group)
        want = None  # inductor's own compile: it keeps fp32 where eager rounds to bf16
        default = generate.SHORT_REDUCTION_BLOCK
        variants = {"inductor's choice": (None, {})}
        for xblock, warps in ((1, 1), (1, 4), (8, 2), (32, 2)):
            variants[f"XBLOCK {xblock}, {warps} warps"] = ({"XBLOCK": xblock, "num_warps": warps},
                                                        {"inductor_choices_class": OnePassReductions})
        for name, (block, options) in variants.items():
            generate.SHORT_REDUCTION_BLOCK = block or default  # read when the kernel is generated
            torch._dynamo.reset()
            fn = torch.compile(merged, options=options)
            got, code = run_and_get_code(fn, *args)
            want = got if want is None else want
            # h, the planes and steps exactly; the sums within fp32 summation order
            same = all(torch.equal(a, b) for a, b in zip(got[:4], want[:4])) and all(
                torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got[4:], want[4:]))
            us = time_us([lambda: fn(*args)], reps=50)
            print(f"| {k}, {group} | {name} | {us:.2f} | "
                  f"{'@triton_heuristics.fixed_config' in ''.join(code)} | {same} |", flush=True)
        generate.SHORT_REDUCTION_BLOCK = default


if __name__ == "__main__":
    main()
