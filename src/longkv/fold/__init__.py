"""KV-Fold: frozen Hugging Face causal LMs over long inputs, chunk by chunk."""

from longkv.fold.fold import FoldResult, check_foldable, kv_fold

__all__ = ["FoldResult", "check_foldable", "kv_fold"]
