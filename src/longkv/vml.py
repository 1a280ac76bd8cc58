"""A guard against oneMKL's VML first-call race (pytorch/pytorch issue 188792).

On CPU, ATen sends contiguous float32 / float64 unary ops (cos, sin, exp, log, sqrt, ...) to
oneMKL's vector math library (VML), each intra-op thread calling it on its slice of the tensor.
oneMKL 2024.2, the version inside the torch 2.x CPU wheels, picks each VML function's kernel on
that function's first call; when the first call runs on several threads at once, one thread can
run the low-accuracy kernel over its whole slice (errors of ~1000 ulp in that call only; every
later call is right). In a fresh process that first call is typically a model's first forward,
e.g. the cos/sin of the RoPE tables. Calling each function once on a one-element tensor (one
thread) settles the choice before any threaded call: the warm-up proposed upstream (pytorch PR
188791). oneMKL >= 2025.0 does not have the race, and builds without MKL skip the warm-up.

`longkv.attention`, `longkv.rwkv` and `longkv.fold` call `warm_up_vml()` when imported, so
every package of longkv that computes (kvm, models, train, evals, bench build on them) is
covered.
"""

from __future__ import annotations

import functools

import torch

# The unary ops whose CPU kernels call VML (ATen's cpu/vml.h), as torch functions.
VML_OPS = (
    "acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2",
    "sin", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip
VML_DTYPES = (torch.float32, torch.float64)


@functools.cache
def warm_up_vml() -> tuple[str, ...]:
    """Call every VML-backed op once, single-threaded, per float dtype; return the ops called.

    Empty where torch is built without MKL (no VML, nothing to settle). Runs once per process.
    """
    if not torch.backends.mkl.is_available():
        return ()
    with torch.inference_mode():
        for dtype in VML_DTYPES:
            x = torch.full((1,), 0.5, dtype=dtype)  # inside every op's domain
            for name in VML_OPS:
                getattr(torch, name)(x)
    return VML_OPS
