"""RWKV7State: what an RWKV-7 layer carries between calls (a fixed-size matrix per head)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RWKV7State:
    """S: (B, H, Dv, Dk), the delta-rule state after `seen` tokens (row = value channel,
    column = key channel); its size does not depend on `seen`."""

    S: Tensor
    seen: int

    @property
    def batch_size(self) -> int:
        """B, the batch rows."""
        return self.S.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the state."""
        return self.S.numel() * self.S.element_size()

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> RWKV7State:
        """A copy on another device and/or floating dtype."""
        return RWKV7State(S=self.S.to(device=device, dtype=dtype), seen=self.seen)

    def select_rows(self, rows: Tensor) -> RWKV7State:
        """The state of batch rows `rows` (R,), in that order (beam reorder, repeat, select)."""
        return RWKV7State(S=self.S.index_select(0, rows.to(self.S.device)), seen=self.seen)
