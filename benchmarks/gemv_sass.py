"""Instructions per weight code in the GEMVs' main loop, from sm_90 SASS, on any machine.

    PYTHONPATH=. python3 benchmarks/gemv_sass.py [--kinds bf16,int8,int4]

Compiles the Triton GEMVs of brisklm/kernels/gemv.py for an H100/H200
(sm_90) without a GPU (Triton ships ptxas and nvdisasm), finds the main
loop (the longest backward branch) and counts its instructions by opcode.
At batch 1 the quantized GEMVs are bound by instructions, not memory (see
benchmarks/JOURNAL.md): bf16 reaches the read ceiling at ~3 instructions a
weight byte, so int8 and int4 need about that many per byte too. Use this to
see what a kernel change costs before spending GPU time on it.
"""
from __future__ import annotations

import argparse
import collections
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from brisklm.kernels import gemv

# kind: (kernel, BLOCK_N, BLOCK_K in codes, warps, constexprs beyond K_PER_SPLIT and BLOCK_N),
# as in the tuned table for the Llama-3.1-8B w13 matrix (4096 inputs)
CASES = {
    "bf16": (gemv._scaled_gemv_kernel, 2, 2048, 4, {"BLOCK_K": 2048, "EVEN_K": True}),
    "int8": (gemv._int8_gemv_kernel, 16, 512, 4, {"BLOCK_K": 512}),
    "int8-g32": (gemv._grouped_gemv_kernel, 16, 512, 4, {"BLOCK_K": 512, "BITS": 8, "GROUP": 32}),
    "int4": (gemv._grouped_gemv_kernel, 32, 1024, 4, {"BLOCK_K": 1024, "BITS": 4, "GROUP": 128}),
    "int8-dp4a": (gemv._int8_dp4a_kernel, 16, 1024, 4, {"BLOCK_K": 1024, "XB": 256, "GROUPED": False,
                                                        "INTERPRET": False}),
    "int8-g32-dp4a": (gemv._int8_dp4a_kernel, 16, 1024, 4, {"BLOCK_K": 1024, "XB": 32, "GROUPED": True,
                                                            "INTERPRET": False}),
    "int4-dp4a": (gemv._int4_dp4a_kernel, 32, 1024, 4, {"BLOCK_K": 1024, "GROUP": 128, "INTERPRET": False,
                                                          "W_ALIGN": 16, "S_ALIGN": 16, "PACKED": False,
                                                          "N_SQ": 32}),  # K = 4096
    "int4-dp4a-packed": (gemv._int4_dp4a_kernel, 16, 1024, 4, {"BLOCK_K": 1024, "GROUP": 128, "INTERPRET": False,
                                                                "W_ALIGN": 16, "S_ALIGN": 16, "PACKED": True,
                                                                "N_SQ": 32}),  # x from pack_x, w13's blocks
    "fp8": (gemv._scaled_gemv_kernel, 16, 512, 4, {"BLOCK_K": 512, "EVEN_K": True}),
    "fp8-half": (gemv._fp8_half_kernel, 64, 512, 4, {"BLOCK_K": 512, "INTERPRET": False}),
}
POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "w8_ptr": "*fp8e4nv", "s_ptr": "*bf16", "z_ptr": "*bf16",
            "out_ptr": "*fp32", "lo_ptr": "*i32", "step_ptr": "*fp32", "xsum_ptr": "*fp32", "sq_ptr": "*fp32",
            "eps": "fp32", "expert_ptr": "*i64"}


def compile_sm90(kind: str):
    fn, block_n, block_k, warps, extra = CASES[kind]
    const = {"K_PER_SPLIT": 64 * block_k, "BLOCK_N": block_n, "PDL": True, **extra}  # a loop, not unrolled
    if "N_SQ" in fn.arg_names:
        const.setdefault("N_SQ", 0)  # no norm folded in
    if "EXPERT" in fn.arg_names:
        const.setdefault("EXPERT", False)  # one matrix, not one of stacked ones
    sig = {}
    for name in fn.arg_names:  # in the kernel's order
        if name in const:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = POINTERS[name]
            if name == "w_ptr" and kind in ("bf16", "fp8"):
                sig[name] = "*bf16" if kind == "bf16" else "*fp8e4nv"
            elif name == "s_ptr" and kind.startswith("int8"):
                sig[name] = "*fp16"
            elif name == "x_ptr" and kind.endswith("packed"):
                sig[name] = "*i32"
        else:
            sig[name] = "i32"  # N, K, one_bits, n_sq
    # As Triton's launcher specializes them for torch tensors and these shapes:
    # pointers and N, K divisible by 16 (this is what lets loads be vectorized).
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
               for name, ty in sig.items() if ty.startswith("*") or name in ("N", "K")}
    return triton.compile(ASTSource(fn, sig, const, aligned), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps})


def loop_opcodes(sass: str) -> collections.Counter:
    lines = sass.splitlines()
    labels = {line[:-1]: i for i, line in enumerate(lines) if re.fullmatch(r"\w+:", line)}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"BRA (\w+);", line)) and labels.get(m.group(1), i) < i]
    first, last = max(loops, key=lambda span: span[1] - span[0])
    ops = collections.Counter()
    for line in lines[first + 1:last + 1]:
        if m := re.search(r"\t(?:@!?U?P\w+ )?([A-Z][A-Z0-9_]*)", line):
            ops[m.group(1)] += 1
    return ops


def weight_load_run(ttgir: str) -> int:
    """Contiguous bytes of one row that one warp-wide load of the weight tile
    reads (its lanes and vectors along the last, contiguous dimension). A tile
    whose lanes spread across rows reads a few bytes of many rows per
    instruction: the fp8 kernel's first version read 16 bytes a row and ran at
    0.68 of the read ceiling where 512 gave 0.93."""
    layouts = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    for line in ttgir.splitlines():
        m = re.search(r"%w\w* = tt\.load .*tensor<[\dx]+x!tt\.ptr<(\w+)>, (#\w+)>", line)
        if m:
            lay = layouts[m.group(2)]
            lanes = int(re.search(r"threadsPerWarp = \[([\d, ]+)\]", lay).group(1).split(",")[-1])
            vector = int(re.search(r"sizePerThread = \[([\d, ]+)\]", lay).group(1).split(",")[-1])
            return lanes * vector * {"i32": 4, "bf16": 2, "f8E4M3FN": 1}.get(m.group(1), 4)
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default=",".join(CASES))
    opts = ap.parse_args()
    print("| kernel | BLOCK_N x BLOCK_K, warps | loop instructions | per code | per weight byte | most frequent "
          "| bytes a row per warp load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind in opts.kinds.split(","):
        _, block_n, block_k, warps, _ = CASES[kind]
        compiled = compile_sm90(kind)
        ops = loop_opcodes(compiled.asm["sass"])
        total = sum(ops.values())
        per_code = total / (block_n * block_k / (32 * warps))  # one loop pass per thread
        bytes_per_code = {"bf16": 2, "int4": 0.5, "int4-dp4a": 0.5, "int4-dp4a-packed": 0.5}.get(kind, 1)
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(5))
        print(f"| {kind} | {block_n} x {block_k}, {warps} | {total} | {per_code:.2f} | "
              f"{per_code / bytes_per_code:.2f} | {top} | {weight_load_run(compiled.asm['ttgir'])} |")


if __name__ == "__main__":
    main()
