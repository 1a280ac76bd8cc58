"""The reads a server keeps: each keyed by its method and the context's token ids it read,
found by the longest of them a request's context begins with, and dropped least recently used
first when their memory passes a cap."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from longkv.document.read import Document
from longkv.document.save import held_bytes

Key = tuple[str, tuple[int, ...]]  # (the read's method label, the context's token ids)


class KeptReads:
    """Kept reads, least recently used first, within cap_bytes of memory in all (their tensors,
    a storage shared by several counted once: `held_bytes`); on_drop sees each key dropped."""

    def __init__(self, cap_bytes: int, on_drop: Callable[[Key], object] | None = None):
        self.cap_bytes = cap_bytes
        self.reads: OrderedDict[Key, Document] = OrderedDict()
        self.on_drop = on_drop

    def find(self, label: str, ids: list[int]) -> tuple[Document | None, int]:
        """The kept read by `label` whose tokens begin ids the longest, and how many tokens it
        read (None, 0 if none does); it becomes the most recently used."""
        begun = [
            key for key in self.reads
            if key[0] == label and tuple(ids[: len(key[1])]) == key[1] and len(key[1]) <= len(ids)
        ]  # fmt: skip
        best = max(begun, key=lambda key: len(key[1]), default=None)
        if best is None:
            return None, 0
        self.reads.move_to_end(best)
        return self.reads[best], len(best[1])

    def keep(self, label: str, ids: list[int], doc: Document) -> bool:
        """Keep doc as the read of ids by label, dropping the least recently used reads while
        all of them pass the cap; False (and doc not kept) where doc alone passes it."""
        key = (label, tuple(ids))
        self.reads[key] = doc
        self.reads.move_to_end(key)
        while self.reads and self.bytes() > self.cap_bytes:
            dropped, _ = self.reads.popitem(last=False)
            if self.on_drop is not None:
                self.on_drop(dropped)
        return key in self.reads

    def bytes(self) -> int:
        """Memory the kept reads hold (`held_bytes`)."""
        return held_bytes(*(doc.runner for doc in self.reads.values()))

    def __len__(self) -> int:
        return len(self.reads)
