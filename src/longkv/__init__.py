"""longkv: long-context memory for transformers (KVM attention, KV-Fold, evaluations).

`import longkv` stays light (no torch): it registers longkv's models with transformers' Auto
classes once transformers' `AutoModel...` classes are imported (or at once, when they are
already), so that `AutoModelForCausalLM.from_pretrained` loads a saved longkv model without
`trust_remote_code`. `longkv.read` and `longkv.load` (a document read once and asked many
questions, `longkv.document`) are imported when first used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

from longkv.version import __version__

__all__ = ["__version__", "load", "read"]

AUTO_MODULE = "transformers.models.auto.modeling_auto"  # where AutoModelForCausalLM lives


class _RegisterWithAuto(importlib.abc.MetaPathFinder):
    """Imports longkv.models (which registers its classes) right after AUTO_MODULE runs."""

    def find_spec(
        self, name: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != AUTO_MODULE:
            return None
        sys.meta_path.remove(self)  # the module's own spec, found by the other finders
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            importlib.import_module("longkv.models")

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if AUTO_MODULE in sys.modules:
    importlib.import_module("longkv.models")
elif not any(isinstance(f, _RegisterWithAuto) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithAuto())


def __getattr__(name: str) -> Any:
    """`read` and `load`, from longkv.document (imported on first use: it imports torch)."""
    if name == "read":
        return importlib.import_module("longkv.document").read
    if name == "load":
        return importlib.import_module("longkv.document.save").load
    raise AttributeError(f"module 'longkv' has no attribute {name!r}")
