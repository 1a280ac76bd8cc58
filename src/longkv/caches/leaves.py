"""The leaves of two-level KVM-Fold: every token that left the window, exact, owned by one slot.

A leaf is a token's key and value as the model produced them, and the slot it founded or merged
into (`caches.kvm_state.update_state`'s dest). A `LeafStore` keeps the leaves of one layer behind
one small interface: `append` the tokens that leave the window, `gather` the leaves of some slots
(all of them for a prefill chunk, whose queries open nearly every slot between them; those of a
few slots for a decoded token), and count its bytes. The stores (`LEAF_STORES`):
- "exact": keys and values in the model's dtype, in memory; opening every slot then gives the
  exact cache.
- "int8": in memory, a code in [-127, 127] per channel and a float32 scale per token and head,
  one for the key and one for the value (scale = the row's largest magnitude / 127), so a
  channel comes back within half a step: |x - read(x)| <= max |row| / 254. A quarter of fp32's
  bytes (plus 8 bytes of scales per token and head).
- "file": exact, in a file (one per layer, in `directory` or the system's temporary folder,
  removed with the store), written and read with plain file I/O, never mapped; only the owners
  stay in memory, and a gather reads the rows of the leaves it returns.
The owners (one int64 per leaf, KV head and row) are always in memory: routing needs them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from typing import BinaryIO, NamedTuple

import numpy as np
import torch
from torch import Tensor

from longkv.attention.state import Rows, tensor_bytes

LEAF_STORES = ("exact", "int8", "file")
LEVELS = 127  # the largest int8 code


class Gathered(NamedTuple):
    """Leaves read from a store: keys (B, Hkv, n, D), values (B, Hkv, n, Dv), owner (B, Hkv, n),
    and valid (B, Hkv, n) bool, False on the padding of a KV head that has fewer leaves than
    another (None: all valid)."""

    keys: Tensor
    values: Tensor
    owner: Tensor
    valid: Tensor | None


class LeafStore:
    """The leaves of one layer, in order of leaving; subclasses say how the keys and values are
    stored (`_append`, `_read`, `nbytes`)."""

    def __init__(self, keys: Tensor, values: Tensor):
        """An empty store for keys (B, Hkv, *, D) and values (B, Hkv, *, Dv)."""
        self.key_dim = keys.shape[-1]
        self.width = self.key_dim + values.shape[-1]
        self.dtype = keys.dtype
        self.owner = Rows.of(keys.new_zeros(*keys.shape[:2], 0, 1, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.owner)

    def append(self, keys: Tensor, values: Tensor, owner: Tensor) -> None:
        """Add the tokens keys (B, Hkv, m, D), values (B, Hkv, m, Dv) owned by owner (B, Hkv, m)."""
        self._append(keys, values)
        self.owner = self.owner.append(owner.unsqueeze(-1), True)

    def gather(self, slots: Tensor | None, dtype: torch.dtype) -> Gathered:
        """The leaves of the slots marked in slots (B, Hkv, S) bool (None: every leaf), in order
        of leaving, keys and values in dtype; a KV head with fewer of them is padded (`valid`)."""
        owner = self.owner.tensor[..., 0]  # (B, Hkv, L)
        if slots is None or bool(slots.all()):
            keys, values = self._read(None, dtype)
            return Gathered(keys, values, owner, None)
        chosen = slots.gather(-1, owner)  # (B, Hkv, L)
        at = chosen.cumsum(-1)  # a chosen leaf's place + 1 among its head's, in order of leaving
        n = at[..., -1:]  # (B, Hkv, 1)
        most = int(n.max())
        index = torch.zeros(*at.shape[:-1], most + 1, dtype=torch.long, device=at.device)
        leaf = torch.arange(at.shape[-1], device=at.device).expand_as(at)
        index = index.scatter_(-1, torch.where(chosen, at - 1, most), leaf)[..., :most]
        valid = None if bool((n == most).all()) else torch.arange(most, device=n.device) < n
        keys, values = self._read(index, dtype)
        return Gathered(keys, values, owner.gather(-1, index), valid)

    def fork(self) -> LeafStore:
        """A store that reads these leaves and appends its own after them, leaving this one as
        it is: its buffers (and file) are this store's, written past the leaves this one holds
        (`Rows.shared`), where an earlier fork may have written: one fork at a time appends."""
        twin = object.__new__(type(self))  # not copy.copy, which pickles (a FileLeaves: no file)
        twin.__dict__.update(vars(self))
        for name, value in vars(self).items():
            if isinstance(value, Rows):
                setattr(twin, name, value.shared())
        return twin

    def reserve(self, n: int) -> None:
        """Make room for n more leaves in the buffers, so that a fork appending up to n of them
        copies none of these (`Rows.with_room`)."""
        for name, value in vars(self).items():
            if isinstance(value, Rows):
                setattr(self, name, value.with_room(n))

    @property
    def nbytes(self) -> int:
        """Bytes of the leaves held in memory (keys and values or their codes, scales, owners)."""
        return tensor_bytes(self.owner.tensor)

    @property
    def file_bytes(self) -> int:
        """Bytes of the leaves kept in a file."""
        return 0

    def _append(self, keys: Tensor, values: Tensor) -> None:
        raise NotImplementedError

    def _read(self, index: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Keys (B, Hkv, n, D) and values of the leaves index (B, Hkv, n) (None: all) in dtype."""
        raise NotImplementedError

    def _split(self, rows: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        D = self.key_dim
        return rows[..., :D].to(dtype), rows[..., D:].to(dtype)


def pick(rows: Tensor | Rows, index: Tensor | None) -> Tensor:
    """rows (B, Hkv, L, w) at index (B, Hkv, n) along dim 2 (None: all of them): whole rows
    taken from the buffer (a Rows' store) by one index_select, not element by element."""
    if isinstance(rows, Rows):
        if index is None:
            return rows.tensor
        data, first = rows.store.data, rows.lo
    else:
        if index is None:
            return rows
        data, first = rows.contiguous(), 0
    B, Hkv, capacity, width = data.shape
    heads = torch.arange(B * Hkv, device=index.device).view(B, Hkv, 1) * capacity + first
    taken = data.view(-1, width).index_select(0, (heads + index).flatten())
    return taken.view(*index.shape, width)


class ExactLeaves(LeafStore):
    """Keys and values in the model's dtype, in memory."""

    KV_FIELDS = ("rows",)  # keys and values (`BoundedRunner.KV_FIELDS`)

    def __init__(self, keys: Tensor, values: Tensor):
        super().__init__(keys, values)
        self.rows = Rows.of(keys.new_zeros(*keys.shape[:2], 0, self.width))

    def _append(self, keys: Tensor, values: Tensor) -> None:
        self.rows = self.rows.append(torch.cat([keys, values], dim=-1), True)

    def _read(self, index: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return self._split(pick(self.rows, index), dtype)

    @property
    def nbytes(self) -> int:
        return super().nbytes + tensor_bytes(self.rows.tensor)


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """int8 codes (..., n) and float32 scales (..., 1) of rows x (..., n): x ~ codes * scale."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / LEVELS
    codes = torch.where(scale > 0, x / scale.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return codes.round().clamp(-LEVELS, LEVELS).to(torch.int8), scale


class Int8Leaves(LeafStore):
    """int8 codes of keys and values, in memory, with a float32 scale per token and head each."""

    def __init__(self, keys: Tensor, values: Tensor):
        super().__init__(keys, values)
        new = keys.new_zeros
        self.codes = Rows.of(new(*keys.shape[:2], 0, self.width, dtype=torch.int8))
        self.scale = Rows.of(new(*keys.shape[:2], 0, 2, dtype=torch.float32))  # key, value

    def _append(self, keys: Tensor, values: Tensor) -> None:
        k_codes, k_scale = quantize(keys)
        v_codes, v_scale = quantize(values)
        self.codes = self.codes.append(torch.cat([k_codes, v_codes], dim=-1), True)
        self.scale = self.scale.append(torch.cat([k_scale, v_scale], dim=-1), True)

    def _read(self, index: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        codes, scale = pick(self.codes, index), pick(self.scale, index)
        keys, values = self._split(codes, torch.float32)
        return (keys * scale[..., :1]).to(dtype), (values * scale[..., 1:]).to(dtype)

    @property
    def nbytes(self) -> int:
        return super().nbytes + tensor_bytes(self.codes.tensor, self.scale.tensor)


class FileLeaves(LeafStore):
    """Keys and values in the model's dtype in a file, a row of every (B, Hkv) per leaf, written
    and read with plain file I/O (not mapped into memory: a mapping's touched pages would count
    in the process's resident set and grow with the input), so that a gather reads only the rows
    of the leaves some KV head chose; the file's pages sit in the kernel's page cache, which
    drops them as it needs."""

    def __init__(self, keys: Tensor, values: Tensor, directory: str | None = None):
        super().__init__(keys, values)
        self.directory = directory
        self.open_file()
        self.heads = tuple(keys.shape[:2])  # (B, Hkv)
        self.row_bytes = self.heads[0] * self.heads[1] * self.width * self.dtype.itemsize

    def open_file(self, source: str | None = None) -> None:
        """A new file of this store's own in its directory, removed with the store; a copy of
        the file `source` (a store's `export`) when given."""
        fd, self.path = tempfile.mkstemp(prefix="longkv-leaves-", suffix=".bin", dir=self.directory)
        self.file = os.fdopen(fd, "r+b")  # buffered: a write or read moves every byte asked
        weakref.finalize(self, remove_file, self.file, self.path)
        if source is not None:
            with open(source, "rb") as saved:
                shutil.copyfileobj(saved, self.file)
            self.file.flush()

    def export(self, path: str) -> None:
        """Write the leaves' rows (the file's first len(self) rows) to a file at path."""
        self.file.seek(0)
        left = len(self) * self.row_bytes
        with open(path, "wb") as out:
            while left:
                block = self.file.read(min(left, 1 << 24))
                if not block:
                    raise OSError(f"{self.path}: the leaves file ends early")
                out.write(block)
                left -= len(block)

    def __getstate__(self) -> dict[str, object]:
        """Everything but the file, which `export` writes and `open_file(source)` reads back."""
        return {k: v for k, v in vars(self).items() if k not in ("file", "path")}

    def _append(self, keys: Tensor, values: Tensor) -> None:
        rows = torch.cat([keys, values], dim=-1).to(self.dtype)  # (B, Hkv, m, width)
        data = rows.permute(2, 0, 1, 3).contiguous().cpu()  # (m, B, Hkv, width)
        self.file.seek(len(self) * self.row_bytes)
        self.file.write(data.view(torch.uint8).reshape(-1).numpy())
        self.file.flush()  # on disk, not in the write buffer, once the chunk's leaves are kept

    def _read(self, index: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        device = self.owner.tensor.device
        if index is None:
            rows = self._rows(np.arange(len(self)), device)
            return self._split(rows, dtype)
        wanted = index.unique()  # sorted leaf numbers some KV head chose
        rows = self._rows(wanted.cpu().numpy(), device)  # (B, Hkv, U, width)
        return self._split(pick(rows, torch.searchsorted(wanted, index.contiguous())), dtype)

    def _rows(self, which: np.ndarray, device: torch.device) -> Tensor:
        """The file's rows `which` (sorted leaf numbers) as (B, Hkv, n, width) in the model's
        dtype, each run of consecutive rows read at once."""
        rows = torch.empty(len(which), *self.heads, self.width, dtype=self.dtype)
        into = rows.view(torch.uint8).reshape(-1).numpy()
        at = 0
        for run in np.split(which, np.flatnonzero(np.diff(which) != 1) + 1) if len(which) else []:
            size = len(run) * self.row_bytes
            self.file.seek(int(run[0]) * self.row_bytes)
            if self.file.readinto(into[at : at + size]) != size:
                raise OSError(f"{self.path}: the leaves file ends early")
            at += size
        return rows.permute(1, 2, 0, 3).to(device)

    @property
    def file_bytes(self) -> int:
        return len(self) * self.row_bytes


def remove_file(file: BinaryIO, path: str) -> None:
    """Close a file and remove it from disk."""
    file.close()
    os.remove(path)


def make_leaves(
    store: str, keys: Tensor, values: Tensor, directory: str | None = None
) -> LeafStore:
    """An empty store of kind `store` (one of LEAF_STORES, as `KVMFoldConfig.leaves` checks) for
    keys (B, Hkv, *, D) and values (B, Hkv, *, Dv); directory: where a "file" store's file goes."""
    if store == "int8":
        return Int8Leaves(keys, values)
    if store == "file":
        return FileLeaves(keys, values, directory)
    return ExactLeaves(keys, values)
