"""KV-Fold: a frozen Hugging Face causal LM over a long input chunk by chunk, the KV cache
carried forward as the accumulator of a left fold; its variants, greedy decoding from the folded
cache, and drift against one full forward. The bounded caches of such models are
`longkv.caches`."""

from longkv.fold.fold import FoldResult, FoldRunner, check_foldable, kv_fold
from longkv.fold.generate import continue_decode, fold_generate
from longkv.vml import warm_up_vml

warm_up_vml()  # before any threaded VML call: see longkv.vml

__all__ = [
    "FoldResult",
    "FoldRunner",
    "check_foldable",
    "continue_decode",
    "fold_generate",
    "kv_fold",
]
