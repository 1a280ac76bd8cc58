"""KV-Fold: frozen Hugging Face causal LMs over long inputs, chunk by chunk; StreamingLLM."""

from longkv.fold.fold import FoldResult, FoldRunner, check_foldable, kv_fold
from longkv.fold.generate import fold_generate, greedy_decode
from longkv.fold.streaming import StreamingRunner, stream, streaming_generate, streaming_llm
from longkv.vml import warm_up_vml

warm_up_vml()  # before any threaded VML call: see longkv.vml

__all__ = [
    "FoldResult",
    "FoldRunner",
    "StreamingRunner",
    "check_foldable",
    "fold_generate",
    "greedy_decode",
    "kv_fold",
    "stream",
    "streaming_generate",
    "streaming_llm",
]
