"""Test data: values that depend on a seed (a rank) and the element index, exact in every dtype under test."""

import math

import torch

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
    torch.int64, torch.bool, torch.complex64
]


def pattern(shape, dtype, seed, device="cpu"):
    """Integers in [-120, 120] (exact in float16 and bfloat16), varying with index and seed; never all zero."""
    i = torch.arange(math.prod(shape), dtype=torch.int64)
    v = (i * 7 + seed * 31 + 3) % 241 - 120
    if dtype == torch.bool:
        out = v % 3 == 0
    elif dtype == torch.uint8:
        out = (v + 121).to(torch.uint8)
    elif dtype.is_complex:
        out = torch.complex(v.float(), -v.float() - seed).to(dtype)
    else:
        out = v.to(dtype)
    return out.view(shape).to(device)


def expect_device(backend):
    return {"HOST": "cpu", "CUDA": "cuda", "HIP": "cuda"}[backend]
