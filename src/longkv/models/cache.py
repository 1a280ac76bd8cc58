"""What the cache directory (`pretrained.cache_dir`) holds: the models converted from GGUF files
(the named ones, `--model smollm2` / `gemma3`, and those of GGUF files passed to --model), the
GGUF files put together from parts and models' int8 weights; listed with their sizes, removed
by name."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from longkv.checks import refuse
from longkv.models.pretrained import CONVERTED_GGUF, GGUF_FILES, PACKAGED, QUANTIZED, cache_dir


@dataclass(frozen=True)
class Cached:
    """One entry of the cache directory: the name that removes it, what it is, its bytes and
    where it is."""

    name: str
    kind: str
    size: int
    path: Path


def tree_bytes(path: Path) -> int:
    """The bytes of a file, or of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cached_models() -> list[Cached]:
    """Every model and GGUF file in the cache directory: the named models by their --model
    name, the others by their file or folder name."""
    root = cache_dir()
    out: list[Cached] = []
    for name, model in PACKAGED.items():
        folder = root / model.folder
        if folder.is_dir():
            out.append(Cached(name, f"{model.title}, converted", tree_bytes(folder), folder))
    for sub, kind in (
        (CONVERTED_GGUF, "converted from a GGUF file"), (GGUF_FILES, "GGUF file"),
        (QUANTIZED, "int8 weights of a model (--weights int8)"),
    ):  # fmt: skip
        for path in sorted((root / sub).glob("*")):
            if not path.name.startswith("."):  # a conversion or a put-together under way
                out.append(Cached(path.name, kind, tree_bytes(path), path))
    return out


def remove_cached(name: str) -> Cached:
    """Remove the cache entry called `name` (`cached_models`); refused, listing the names,
    where there is none."""
    found = {c.name: c for c in cached_models()}
    if name not in found:
        names = ", ".join(found) or f"none: {cache_dir()} holds no model"
        refuse(None, "remove", f"no cached model is called {name!r} (there are: {names})")
    entry = found[name]
    if entry.path.is_dir():
        shutil.rmtree(entry.path)
    else:
        entry.path.unlink()
    return entry
