"""The carried KVM state: compressed slots plus the raw tokens of the current window."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from longkv.attention.state import WindowCache
from longkv.kvm.config import KVMConfig


def window_start(config: KVMConfig, seen: int) -> int:
    """wb(n): the first token of the window once `seen` tokens exist (spec section 1)."""
    C = config.chunk_len
    return max(0, -(-seen // C) * C - config.window_len)


def covered(config: KVMConfig, seen: int) -> int:
    """Tokens [0, covered) that the slots summarise once `seen` tokens exist.

    The first chunk is copied into the state as soon as it arrives; later chunks enter when
    they leave the window, i.e. lazily at the first token of the next chunk.
    """
    return max(min(seen, config.chunk_len), window_start(config, seen))


@dataclass(frozen=True)
class KVMState:
    """State carried between calls of `kvm_attention`.

    slot_k: (B, Hkv, S, Dk) accumulated prepared keys; slot_v: (B, Hkv, S, Dv) accumulated
    values; slot_r: (B, Hkv, S) founder value norm (vlens mode) or token count (count mode);
    window: the raw keys, values and gates of tokens [window_start(seen), seen).
    """

    config: KVMConfig
    slot_k: Tensor
    slot_v: Tensor
    slot_r: Tensor
    window: WindowCache

    @property
    def seen(self) -> int:
        """Tokens processed so far."""
        return self.window.seen

    @property
    def num_slots(self) -> int:
        """S, the same for every batch row and head."""
        return self.slot_k.shape[2]

    @property
    def batch_size(self) -> int:
        """B, the batch rows."""
        return self.slot_k.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the state's tensors."""
        slots = sum(t.numel() * t.element_size() for t in (self.slot_k, self.slot_v, self.slot_r))
        return slots + self.window.nbytes

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> KVMState:
        """A copy on another device and/or floating dtype."""
        moved = {
            f.name: getattr(self, f.name).to(device=device, dtype=dtype)
            for f in fields(self)
            if f.name.startswith("slot_")
        }
        return replace(self, window=self.window.to(device=device, dtype=dtype), **moved)

    def select_rows(self, rows: Tensor) -> KVMState:
        """The state of batch rows `rows` (R,), in that order (beam reorder, repeat, select)."""
        rows = rows.to(self.slot_k.device)
        return replace(
            self,
            slot_k=self.slot_k.index_select(0, rows),
            slot_v=self.slot_v.index_select(0, rows),
            slot_r=self.slot_r.index_select(0, rows),
            window=self.window.select_rows(rows),
        )
