"""A read kept on disk: `save` a `Document` to a folder, `load` it back to ask it more.

The folder holds `state.pkl` (the read's objects: the runner, its bounded part and the
settings, pickled with every tensor and module left out), `tensors.pt` (the tensors, loaded
with torch's weights-only loader), one `leaves-<layer>.bin` per layer of a "file" leaf store
(its rows), and `manifest.json`, written last: the library version and save format, the model
(id, dtype and a fingerprint of its weights), a fingerprint of the tokenizer, the method and
its settings, the document's token count, the dtype its keys and values are kept in, and the
bytes and SHA-256 of every other file.

Keys and values (the tensors under the fields a runner's classes name in `KV_FIELDS`: the
fold's cache, the sinks and windows, the leaves, the read-outs and bounds that are read like
keys) are kept in `kv_dtype`: by default ("auto") float16 for a float32 read, whose answers
measured equal to the kept read's (results/document_bench.md), and as held otherwise; a tensor
whose values pass the narrower dtype's range stays as held. Sums, counts, positions and
frequencies stay as held, so a slot's mean is never the mean of rounded sums. A load widens
the keys and values back to the dtype they were held in.

A save goes to a temporary folder beside the target, each file synced, and is renamed into
place: a crash mid-save leaves the old save or none. `load` refuses, in one line naming the
cause, a folder without a manifest, a file whose size or checksum differs from it (truncated,
corrupted), another save format or library version, a model or tokenizer other than the
save's; `state.pkl` is unpickled with only longkv's classes and a few plain types allowed, so a
save cannot run code of its own.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from longkv.attention.state import Rows, owned_rows
from longkv.caches.bounded import BoundedRunner
from longkv.caches.leaves import FileLeaves
from longkv.caches.retrieval import RetrievalRunner
from longkv.checks import require
from longkv.document.read import AUTO, LEAF_ROOM, Document
from longkv.dtypes import DTYPES
from longkv.models.pretrained import load_pretrained
from longkv.version import __version__

# the save format: what the files are and what the manifest says (2: two-level KVM-Fold's slot
# sums hold their keys' squared norms; 3: keys and values in `kv_dtype`)
FORMAT = 3
# `kv_dtype` AUTO: the dtype keys and values held in a dtype here are kept in (others: as held)
NARROWER = {torch.float32: torch.float16}
MANIFEST, STATE, TENSORS = "manifest.json", "state.pkl", "tensors.pt"
SAMPLES = 4096  # values of each parameter the weights' fingerprint reads
# what a save may hold besides longkv's classes: transformers' cache, a few plain types, and
# the one function that rebuilds an unpickled `Rows`
ALLOWED = {
    ("transformers.cache_utils", name)
    for name in ("DynamicCache", "DynamicLayer", "DynamicSlidingWindowLayer", "Cache")
} | {
    ("copyreg", "_reconstructor"), ("builtins", "object"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "slice"), ("collections", "OrderedDict"),
    ("torch", "device"), ("torch", "Size"), ("longkv.attention.state", "owned_rows"),
}  # fmt: skip


class SavedReadError(ValueError):
    """A save that cannot be loaded: the message says why, in one line."""


def model_fingerprint(model: nn.Module) -> str:
    """SHA-256 over every parameter's and buffer's name, shape and dtype and SAMPLES of its
    values spread over it: another model (or the same one fine-tuned) differs."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // SAMPLES)
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
            h.update(flat[::step][:SAMPLES].double().cpu().numpy().tobytes())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 over the tokenizer's vocabulary, special tokens and chat template."""
    vocab = sorted(tokenizer.get_vocab().items())
    parts = [vocab, tokenizer.all_special_tokens, getattr(tokenizer, "chat_template", None)]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read a block at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def tensors_under(root: object) -> Iterator[tuple[Tensor | Rows, bool]]:
    """The tensors and `Rows` under root (not a module's), each with whether it holds keys and
    values: reached through a field that its object's class (or a base) names in `KV_FIELDS`."""
    seen: set[tuple[int, bool]] = set()
    todo: list[tuple[object, bool]] = [(root, False)]
    while todo:
        obj, inside = todo.pop()
        if (id(obj), inside) in seen or isinstance(obj, nn.Module):
            continue
        seen.add((id(obj), inside))
        if isinstance(obj, (Tensor, Rows)):
            yield obj, inside
        elif isinstance(obj, (list, tuple)):
            todo.extend((item, inside) for item in obj)
        elif isinstance(obj, dict):
            todo.extend((item, inside) for item in obj.values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            fields = {f for c in type(obj).__mro__ for f in vars(c).get("KV_FIELDS", ())}
            todo.extend((v, inside or k in fields) for k, v in vars(obj).items())


def kv_parts(root: object) -> set[int]:
    """ids of the tensors and `Rows` under root that hold keys and values (`tensors_under`)."""
    return {id(t) for t, inside in tensors_under(root) if inside}


def held_bytes(*roots: object) -> int:
    """Bytes of memory the tensors under roots hold (not a module's weights), each storage
    counted once however many of them share it."""
    storages = {}
    for root in roots:
        for t, _ in tensors_under(root):
            storage = (t.tensor if isinstance(t, Rows) else t).untyped_storage()
            storages[storage.data_ptr(), storage.device] = storage.nbytes()
    return sum(storages.values())


def kept_dtype(kv_dtype: str, held: torch.dtype) -> torch.dtype:
    """The dtype keys held in dtype `held` are kept in under `kv_dtype` (AUTO or a `DTYPES`
    name): a narrower one, or `held`."""
    if kv_dtype == AUTO:
        return NARROWER.get(held, held)
    want = DTYPES[kv_dtype]
    return want if want.itemsize < held.itemsize else held


class StatePickler(pickle.Pickler):
    """Pickles a read's objects with the model's modules by name, tensors (and `Rows`, as their
    rows) by number (collected in `tensors`, saved apart; the keys and values, ids in `kv`, in
    the dtype `kv_dtype` says) and the `rebuilt` object (a bounded runner's cache of its last
    forward, which its next forward builds anew) as an empty cache."""

    def __init__(
        self, file: io.BufferedWriter, model: nn.Module, rebuilt: object, kv: set[int],
        kv_dtype: str,
    ) -> None:  # fmt: skip
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.modules = {id(m): name for name, m in model.named_modules()}
        self.tensors: list[Tensor] = []
        self.rebuilt, self.kv, self.kv_dtype = rebuilt, kv, kv_dtype

    def persistent_id(self, obj: object) -> tuple[str, object, torch.dtype | None] | None:
        if obj is self.rebuilt and obj is not None:
            return ("rebuilt", None, None)
        if isinstance(obj, nn.Module):
            if id(obj) not in self.modules:
                raise TypeError(f"a read holds a module outside its model: {type(obj).__name__}")
            return ("module", self.modules[id(obj)], None)
        if isinstance(obj, (Tensor, Rows)):
            t = obj.tensor if isinstance(obj, Rows) else obj.detach()
            held, kept = t.dtype, t.dtype
            if id(obj) in self.kv and t.is_floating_point():
                kept = kept_dtype(self.kv_dtype, held)
                if t.numel() and float(t.abs().amax()) > torch.finfo(kept).max:
                    kept = held  # past the narrower dtype's range
            if isinstance(obj, Rows) or kept != held or not t.is_contiguous():  # a packed
                # layer's rows are a view of storage with room for more (`fold.packed`)
                t = t.to(kept, memory_format=torch.contiguous_format, copy=True)
            self.tensors.append(t)
            kind = "rows" if isinstance(obj, Rows) else "tensor"
            return (kind, len(self.tensors) - 1, None if kept == held else held)
        return None


class StateUnpickler(pickle.Unpickler):
    """Unpickles what `StatePickler` wrote: longkv's classes (and `ALLOWED`) only, the modules
    from `model`, the tensors from `tensors`."""

    def __init__(self, file: io.BufferedReader, model: nn.Module, tensors: list[Tensor]):
        super().__init__(file)
        self.model, self.tensors = model, tensors

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED or module.split(".")[0] == "longkv":
            found = super().find_class(module, name)
            if isinstance(found, type) or (module, name) in ALLOWED:
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"holds {module}.{name}, which a read never holds")

    def persistent_load(self, pid: Any) -> Any:
        kind, key, held = pid
        if kind == "rebuilt":
            return DynamicCache()
        if kind == "module":
            return self.model.get_submodule(key)
        t = self.tensors[key]
        if held is not None:  # keys or values kept narrower than they were held
            t = t.to(held)
        return owned_rows(t) if kind == "rows" else t


def fsync_path(path: Path) -> None:
    """Flush a file's (or folder's) data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(doc: Document, path: str | Path, kv_dtype: str = AUTO) -> Path:
    """Keep a read in folder `path` (replaced if it holds an earlier save), atomically, its keys
    and values in `kv_dtype` (AUTO: float16 for a float32 read; or a `DTYPES` name, used where
    it is narrower than the dtype they are held in)."""
    require(
        kv_dtype == AUTO or kv_dtype in DTYPES, None, "kv_dtype",
        f"must be {AUTO!r} or one of {sorted(DTYPES)}, got {kv_dtype!r}",
    )  # fmt: skip
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.saving-", dir=target.parent))
    try:
        write_files(doc, tmp, kv_dtype)
        fsync_path(tmp)
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            target.rename(old / "save")  # the old save is gone from `path` only once the
            tmp.rename(target)  # new one is complete; between the two, `path` holds none
            shutil.rmtree(old)
        else:
            tmp.rename(target)
        fsync_path(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def write_files(doc: Document, folder: Path, kv_dtype: str) -> None:
    """The save's files in folder, the manifest last."""
    state = {"settings": doc.settings, "runner": doc.runner, "pending": doc.pending}
    with open(folder / STATE, "wb") as f:
        rebuilt = doc.runner.cache if isinstance(doc.runner, BoundedRunner) else None
        pickler = StatePickler(f, doc.model, rebuilt, kv_parts(doc.runner), kv_dtype)
        pickler.dump(state)
    torch.save(pickler.tensors, folder / TENSORS)
    for layer, store in enumerate(leaf_stores(doc.runner)):
        if isinstance(store, FileLeaves):
            store.export(str(folder / f"leaves-{layer}.bin"))
    files = {}
    for item in sorted(folder.iterdir()):
        fsync_path(item)
        files[item.name] = {"bytes": item.stat().st_size, "sha256": file_sha256(item)}
    s = doc.settings
    kept_name = dtype_name(kept_dtype(kv_dtype, next(doc.model.parameters()).dtype))
    config = None if s.config is None else {"class": type(s.config).__name__, **asdict(s.config)}
    manifest = {
        "format": FORMAT, "longkv": __version__,
        "model": {
            "id": doc.model_id, "dtype": dtype_name(doc.model),
            "fingerprint": model_fingerprint(doc.model),
        },
        "tokenizer": {"fingerprint": tokenizer_fingerprint(doc.tokenizer)},
        "settings": {**asdict(s), "config": config},  # method, label, chunks, chat
        "tokens": doc.tokens, "pending": len(doc.pending),
        "kv_dtype": {"asked": kv_dtype, "kept": kept_name},  # kept: for the model's dtype
        "files": files,
    }  # fmt: skip
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
    fsync_path(folder / MANIFEST)


def dtype_name(of: nn.Module | torch.dtype) -> str:
    """The name (`DTYPES`) of a dtype, or of a model's parameters' dtype."""
    dtype = next(of.parameters()).dtype if isinstance(of, nn.Module) else of
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype))


def leaf_stores(runner: object) -> list[object]:
    """The runner's leaf store per layer (None where a layer keeps none); [] without leaves."""
    return list(runner.leaves) if isinstance(runner, RetrievalRunner) else []


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a save, after checking every file it names: present, of its size and
    checksum."""
    where = f"read {folder}"
    if not folder.is_dir():
        what = "is a file, not a save's folder" if folder.exists() else "does not exist"
        raise SavedReadError(
            f"{where}: the folder {what} (a read is saved by `longkv read --save` or Document.save)"
        )
    if not (folder / MANIFEST).is_file():
        raise SavedReadError(
            f"{where}: no {MANIFEST}, so not a saved read (or its save did not end)"
        )
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise SavedReadError(f"{where}: {MANIFEST} is corrupted ({err})") from None
    if manifest.get("format") != FORMAT:
        raise SavedReadError(
            f"{where}: save format {manifest.get('format')}, and this longkv reads format {FORMAT}"
        )
    if manifest.get("longkv") != __version__:
        raise SavedReadError(
            f"{where}: saved by longkv {manifest.get('longkv')}, and this is longkv "
            f"{__version__}; a read is kept by the version that made it: read it again"
        )
    for name, want in files.items():
        item = folder / name
        if not item.is_file():
            raise SavedReadError(f"{where}: {name} is missing")
        size = item.stat().st_size
        if size != want["bytes"]:
            raise SavedReadError(
                f"{where}: {name} is truncated or changed ({size} bytes, saved {want['bytes']})"
            )
        if file_sha256(item) != want["sha256"]:
            raise SavedReadError(f"{where}: {name} is corrupted (its checksum differs)")
    return manifest


def load(
    path: str | Path,
    model: nn.Module | None = None,
    tokenizer: Any = None,
    *,
    device: str | torch.device = "cpu",
) -> Document:
    """The read kept in folder `path` (`save`), to ask again. Without model and tokenizer,
    those the save names are loaded (`load_pretrained`), in its dtype, on `device`."""
    folder = Path(path)
    manifest = read_manifest(folder)
    where = f"read {folder}"
    saved = manifest["model"]
    if model is None or tokenizer is None:
        loaded = load_pretrained(saved["id"], DTYPES[saved["dtype"]], device)
        model, tokenizer = model or loaded[0], tokenizer or loaded[1]
    if model_fingerprint(model) != saved["fingerprint"]:
        raise SavedReadError(
            f"{where}: saved with model {saved['id']} ({saved['dtype']}), and this model's "
            "weights differ; load it with that model"
        )
    if tokenizer_fingerprint(tokenizer) != manifest["tokenizer"]["fingerprint"]:
        raise SavedReadError(f"{where}: saved with another tokenizer than this one")
    tensors = torch.load(folder / TENSORS, map_location=device, weights_only=True)
    with open(folder / STATE, "rb") as f:
        try:
            state = StateUnpickler(f, model, tensors).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, IndexError) as err:
            raise SavedReadError(f"{where}: {STATE} cannot be read ({err})") from None
    runner = state["runner"]
    for layer, store in enumerate(leaf_stores(runner)):
        if isinstance(store, FileLeaves):
            if store.directory is not None and not os.path.isdir(store.directory):
                store.directory = None  # the saver's folder is not here: the temporary one
            store.open_file(str(folder / f"leaves-{layer}.bin"))
        if store is not None:
            store.reserve(LEAF_ROOM)
    return Document(
        model, tokenizer, state["settings"], runner, state["pending"], manifest["tokens"],
        model_id=saved["id"],
    )  # fmt: skip
