"""KV-Fold: frozen Hugging Face causal LMs over long inputs, chunk by chunk."""

from longkv.fold.fold import FoldResult, check_foldable, kv_fold
from longkv.fold.generate import fold_generate, greedy_decode

__all__ = ["FoldResult", "check_foldable", "fold_generate", "greedy_decode", "kv_fold"]
