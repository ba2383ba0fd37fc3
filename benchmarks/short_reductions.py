"""The residual add and gemv.pack_x of the int4 decode step, compiled alone:
the kernel's time per call for each number of groups a program takes
(XBLOCK), and under brisk's compiler options (generate.OnePassReductions,
which fixes the block of reductions under 256 values), whose generated
code must say so and whose outputs must equal inductor's own compile.

    PYTHONPATH=. python3 benchmarks/short_reductions.py   # on a CUDA device

Inductor otherwise times up to three XBLOCKs at the first run and keeps the
fastest; in the decode step its pick for this kernel varied between compiles.
"""
import torch
from torch._inductor.codegen.triton import FixedTritonConfig
from torch._inductor.utils import run_and_get_code

from brisklm.generate import OnePassReductions
from brisklm.kernels import gemv


def merged(res, partials, g, group):
    """The residual add and gemv.pack_x as the decode step runs them."""
    h = res + partials.sum(0).to(torch.bfloat16)
    return h, *gemv.pack_x(h, group, g)


def fixed(xblock, warps):
    """Choices that fix every short reduction at (xblock, warps), as a class of
    this module (the compiler pickles it into its cache key)."""
    def new(cls):
        choices = OnePassReductions()
        base = choices.triton_kernel_kwargs

        def kwargs(kernel_cls, features, groups, kernel_kwargs):
            out = base(kernel_cls, features, groups, kernel_kwargs)
            if out.get("fixed_config"):
                out["fixed_config"] = FixedTritonConfig({"XBLOCK": xblock, "num_warps": warps})
            return out
        choices.triton_kernel_kwargs = kwargs
        choices.uuid = lambda: f"short-reductions-{xblock}-{warps}"
        return choices
    name = f"Fixed_{xblock}_{warps}"
    globals()[name] = type(name, (), {"__new__": new, "__module__": __name__})
    return globals()[name]


def us_per_call(fn, args, calls=50):
    fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best


def main():
    torch.manual_seed(0)
    print("| K, group | compiled with | us per call | fixed config in code | outputs as inductor's own |")
    print("| --- | --- | --- | --- | --- |")
    for k, group in ((4096, 128), (14336, 128)):
        args = (torch.randn(k, device="cuda").bfloat16(), torch.randn(4, k, device="cuda"),
                torch.rand(k, device="cuda").bfloat16(), group)
        want = None  # inductor's own compile: it keeps fp32 where eager rounds to bf16
        variants = {"inductor's choice": {}, "brisk (OnePassReductions)": {"inductor_choices_class": OnePassReductions}}
        for xblock, warps in ((1, 1), (1, 4), (8, 2), (32, 2)):
            variants[f"XBLOCK {xblock}, {warps} warps"] = {"inductor_choices_class": fixed(xblock, warps)}
        for name, options in variants.items():
            torch._dynamo.reset()
            fn = torch.compile(merged, options=options)
            got, code = run_and_get_code(fn, *args)
            want = got if want is None else want
            # h, the planes and steps exactly; the sums within fp32 summation order
            same = all(torch.equal(a, b) for a, b in zip(got[:4], want[:4])) and all(
                torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got[4:], want[4:]))
            print(f"| {k}, {group} | {name} | {us_per_call(fn, args):.2f} | "
                  f"{'@triton_heuristics.fixed_config' in ''.join(code)} | {same} |", flush=True)


if __name__ == "__main__":
    main()
