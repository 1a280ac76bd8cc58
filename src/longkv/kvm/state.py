"""The carried KVM state: compressed slots plus the raw tokens of the current window."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from longkv.attention.state import Rows, WindowCache
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
class ReadOut:
    """The slots' just-in-time read-out, kept while the slots and the LN_s parameters it was
    read with stay the same: keys LN_s(s_k) (B, Hkv, S, Dk), values (B, Hkv, S, Dv)."""

    keys: Tensor
    values: Tensor
    norm: tuple[object, ...]

    @staticmethod
    def norm_of(weight: Tensor | None, bias: Tensor | None) -> tuple[object, ...]:
        """What identifies LN_s parameters: the tensors and their in-place versions."""
        return (
            weight, bias,
            None if weight is None else weight._version,
            None if bias is None else bias._version,
        )  # fmt: skip

    def matches(self, weight: Tensor | None, bias: Tensor | None) -> bool:
        """Whether the read-out was made with these very parameters, unchanged since."""
        w, b, wv, bv = self.norm
        return (
            w is weight and b is bias
            and wv == (None if weight is None else weight._version)
            and bv == (None if bias is None else bias._version)
        )  # fmt: skip


@dataclass(frozen=True)
class KVMState:
    """State carried between calls of `kvm_attention`.

    slots: (B, Hkv, S, Dk + Dv + 1) rows [s_k | s_v | r]: accumulated prepared keys, accumulated
    values, and the founder value norm (vlens mode) or token count (count mode), in one buffer
    (`Rows`) so that a merge is one indexed add and appending writes in place; window: the raw
    keys, values and gates of tokens [window_start(seen), seen); read: the slots' read-out, if
    computed since they last changed; founders: (B, Hkv, S, 1) long, the position of the token
    that founded each slot, where the sequence was started with track_founders (else None).
    """

    config: KVMConfig
    slots: Rows
    window: WindowCache
    read: ReadOut | None = None
    founders: Rows | None = None

    @classmethod
    def of(
        cls,
        config: KVMConfig,
        slot_k: Tensor,
        slot_v: Tensor,
        slot_r: Tensor,
        window: WindowCache,
    ) -> KVMState:
        """A state from its slots: slot_k (B, Hkv, S, Dk), slot_v (B, Hkv, S, Dv), slot_r (B,
        Hkv, S)."""
        return cls(config, Rows.of(pack_slots(slot_k, slot_v, slot_r)), window)

    @property
    def _key_dim(self) -> int:
        return self.window.k.shape[-1]

    @property
    def slot_k(self) -> Tensor:
        """(B, Hkv, S, Dk) accumulated prepared keys."""
        return self.slots.tensor[..., : self._key_dim]

    @property
    def slot_v(self) -> Tensor:
        """(B, Hkv, S, Dv) accumulated values."""
        return self.slots.tensor[..., self._key_dim : -1]

    @property
    def slot_r(self) -> Tensor:
        """(B, Hkv, S) founder value norm (vlens mode) or token count (count mode)."""
        return self.slots.tensor[..., -1]

    @property
    def seen(self) -> int:
        """Tokens processed so far."""
        return self.window.seen

    @property
    def num_slots(self) -> int:
        """S, the same for every batch row and head."""
        return len(self.slots)

    @property
    def batch_size(self) -> int:
        """B, the batch rows."""
        return self.slots.tensor.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the slots and window tokens held (`storage_bytes`: with the buffers'
        room to grow)."""
        slots = self.slots.tensor
        return slots.numel() * slots.element_size() + self.window.nbytes

    @property
    def storage_bytes(self) -> int:
        """Bytes of the buffers holding the state, their room to grow included."""
        return self.slots.storage_bytes + self.window.storage_bytes

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> KVMState:
        """A copy on another device and/or floating dtype."""
        return replace(
            self,
            slots=self.slots.to(device, dtype),
            window=self.window.to(device=device, dtype=dtype),
            read=None,
            founders=None if self.founders is None else self.founders.to(device),
        )

    def select_rows(self, rows: Tensor) -> KVMState:
        """The state of batch rows `rows` (R,), in that order (beam reorder, repeat, select)."""
        return replace(
            self,
            slots=self.slots.select_rows(rows),
            window=self.window.select_rows(rows),
            read=None,
            founders=None if self.founders is None else self.founders.select_rows(rows),
        )


def pack_slots(slot_k: Tensor, slot_v: Tensor, slot_r: Tensor) -> Tensor:
    """The rows [s_k | s_v | r] (B, Hkv, S, Dk + Dv + 1) of slots k, v (B, Hkv, S, D) and r."""
    return torch.cat([slot_k, slot_v, slot_r.unsqueeze(-1)], dim=-1)
