"""Kept reads on disk (`longkv serve --store DIR`), loaded again when the server restarts.

Each read is a save of `document.save` (verified, written to a temporary folder and renamed
into place) in DIR/<digest>, its keys and values as held, so that a read loaded answers as the
read kept did, bit for bit; then its key (the method's label and the context's token ids) in
DIR/<digest>.json, written the same way. A read counts only once both are in place: a server
killed at any moment leaves, besides whole reads, a temporary folder, a save without its key,
or none. At start every whole read is loaded (`Store.load`); anything else in DIR, and a read
that `document.save.load` refuses (damaged, another model's), is removed, with one line each.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from longkv.document.read import Document
from longkv.document.save import SavedReadError, dtype_name, fsync_path, load
from longkv.fold.compat import input_device
from longkv.serve.kept import Key

KEY_SUFFIX = ".json"


class Store:
    """The reads a server keeps, in folder `folder`, for the server's model and tokenizer."""

    def __init__(self, folder: str | Path, model: nn.Module, tokenizer: Any):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.model, self.tokenizer = model, tokenizer

    def path(self, key: Key) -> Path:
        """The folder of key's read: a digest of its label and token ids."""
        digest = hashlib.sha256(json.dumps([key[0], list(key[1])]).encode()).hexdigest()[:32]
        return self.folder / digest

    def save(self, key: Key, doc: Document) -> None:
        """Keep doc as key's read (its keys and values as held), then its key."""
        path = self.path(key)
        doc.save(path, kv_dtype=dtype_name(doc.model))
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.key-", dir=self.folder)
        with os.fdopen(fd, "w") as f:
            json.dump({"label": key[0], "ids": list(key[1])}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path.with_suffix(KEY_SUFFIX))
        fsync_path(self.folder)

    def drop(self, key: Key) -> None:
        """Remove key's read: its key first, so that no key is ever left without its read."""
        path = self.path(key)
        path.with_suffix(KEY_SUFFIX).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)

    def load(self) -> list[tuple[Key, Document]]:
        """Every whole read in the folder, oldest first; the rest removed, one line each."""
        found: list[tuple[float, Key, Document]] = []
        whole: set[str] = set()
        for path in sorted(self.folder.glob(f"*{KEY_SUFFIX}")):
            read = path.with_suffix("")
            try:
                data = json.loads(path.read_text())
                key: Key = (str(data["label"]), tuple(int(t) for t in data["ids"]))
                doc = load(read, self.model, self.tokenizer, device=input_device(self.model))
            except (SavedReadError, ValueError, KeyError, TypeError, OSError) as err:
                print(f"dropped the kept read {read.name}: {err}", file=sys.stderr)
                continue
            whole.update((path.name, read.name))
            found.append((path.stat().st_mtime, key, doc))
        for path in sorted(self.folder.iterdir()):
            if path.name not in whole:
                print(f"removed {path.name}: not a whole kept read", file=sys.stderr)
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        return [(key, doc) for _, key, doc in sorted(found, key=lambda f: f[0])]
