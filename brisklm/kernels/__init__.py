"""Triton kernels for the GPU decode path (see gemv.py)."""
