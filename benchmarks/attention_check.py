"""The decode attention kernel (brisklm/kernels/attention.py) on a GPU.

    PYTHONPATH=. python3 benchmarks/attention_check.py

Correctness against fp64 at the Llama-3.1-8B and SmolLM2 head shapes, bf16
and int8 caches, at several filled lengths; then the time of one call
(replayed in a CUDA graph) against the bytes of the filled cache it reads.
"""
from __future__ import annotations

import math

import torch

from brisklm.kernels.attention import decode_attention, num_splits
from gemv_sweep import time_us  # a CUDA graph of the calls, best of 3


def make(h, hkv, d, S, int8):
    k = torch.randn(1, hkv, S, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, hkv, S, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, h, 1, d, device="cuda", dtype=torch.bfloat16)
    if not int8:
        return q, (k, v), (k.double(), v.double())
    ks, vs = ((t.float().abs().amax(-1, keepdim=True) / 127).bfloat16() for t in (k, v))
    kq, vq = (torch.round(t.float() / s.float()).to(torch.int8) for t, s in ((k, ks), (v, vs)))
    return q, (kq, vq, ks, vs), (kq.double() * ks.double(), vq.double() * vs.double())


def call(q, cache, pos):
    k, v, *scales = cache
    return decode_attention(q, k, v, pos, *scales)


def check(h, hkv, d, S, int8):
    q, cache, (kd, vd) = make(h, hkv, d, S, int8)
    worst = 0.0
    for p in (0, 100, S // 3, S - 1):
        pos = torch.tensor([p], device="cuda")
        y = call(q, cache, pos)
        kk, vv = (t[0, :, :p + 1].repeat_interleave(h // hkv, 0) for t in (kd, vd))
        ref = torch.softmax(q.double()[0] @ kk.transpose(1, 2) / math.sqrt(d), -1) @ vv
        worst = max(worst, ((y.double()[0] - ref).norm() / ref.norm()).item())
    return worst


def kernel_us(h, hkv, d, S, int8, length):
    q, cache, _ = make(h, hkv, d, S, int8)
    pos = torch.tensor([length - 1], device="cuda")
    return time_us([lambda: call(q, cache, pos)], reps=50)


def main():
    print("| heads (q/kv/dim) | cache | kv | splits | worst relative error vs fp64 |\n| --- | --- | --- | --- | --- |")
    for h, hkv, d in ((32, 8, 128), (9, 3, 64)):
        for S in (1024, 33000):
            for int8 in (False, True):
                err = check(h, hkv, d, S, int8)
                print(f"| {h}/{hkv}/{d} | {S} | {'int8' if int8 else 'bf16'} | {num_splits(S)} | {err:.1e} |",
                      flush=True)
                assert err < 4e-3, err
    print("\n| kv | cache size | filled | us | GB/s of the filled cache |\n| --- | --- | --- | --- | --- |")
    for int8 in (False, True):
        for S, length in ((256, 5), (33000, 5), (33000, 1024), (33000, 8192), (33000, 32768)):
            us = kernel_us(32, 8, 128, S, int8, length)
            per_pos = 2 * 8 * 128 * (1 if int8 else 2) + (2 * 8 * 2 if int8 else 0)
            print(f"| {'int8' if int8 else 'bf16'} | {S} | {length} | {us:.1f} | "
                  f"{per_pos * length / us / 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
