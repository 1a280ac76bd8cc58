"""KV-Fold: frozen Hugging Face causal LMs over long inputs, chunk by chunk; bounded caches for
the same models (StreamingLLM, SnapKV, KVM-Fold)."""

from longkv.fold.bounded import BoundedConfig, BoundedRunner, bounded_fold, bounded_generate
from longkv.fold.eviction import SnapKVConfig, SnapKVRunner
from longkv.fold.fold import FoldResult, FoldRunner, check_foldable, kv_fold
from longkv.fold.generate import fold_generate, greedy_decode
from longkv.fold.kvm_cache import KVMFoldConfig, KVMFoldRunner
from longkv.fold.methods import run_bounded
from longkv.fold.streaming import StreamingRunner, stream, streaming_generate, streaming_llm
from longkv.vml import warm_up_vml

warm_up_vml()  # before any threaded VML call: see longkv.vml

__all__ = [
    "BoundedConfig",
    "BoundedRunner",
    "FoldResult",
    "FoldRunner",
    "KVMFoldConfig",
    "KVMFoldRunner",
    "SnapKVConfig",
    "SnapKVRunner",
    "StreamingRunner",
    "bounded_fold",
    "bounded_generate",
    "check_foldable",
    "fold_generate",
    "greedy_decode",
    "kv_fold",
    "run_bounded",
    "stream",
    "streaming_generate",
    "streaming_llm",
]
