"""The floating dtypes the commands and benchmarks take, by the names they are given as."""

from __future__ import annotations

import torch

DTYPES = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
