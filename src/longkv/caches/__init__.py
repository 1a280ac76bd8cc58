"""Bounded caches for frozen Hugging Face causal LMs: the model reads a long input in chunks
and keeps at most a budget of cache entries per layer and KV head. StreamingLLM (sinks + recent
window), SnapKV-style eviction, KVM-Fold (sinks + a KVM state of slots + recent window), and the
retrieval caches, which keep every token exact outside the budget and open some of them per
query: two-level KVM-Fold (its slots opened to the exact tokens they own), Quest (pages) and
InfLLM (blocks); their naive references and the method table the commands share."""

from longkv.caches.bounded import BoundedConfig, BoundedRunner, bounded_fold, bounded_generate
from longkv.caches.eviction import SnapKVConfig, SnapKVRunner
from longkv.caches.infllm import InfLLMConfig, InfLLMRunner
from longkv.caches.kvm_fold import KVMFoldConfig, KVMFoldRunner
from longkv.caches.methods import make_runner, run_bounded
from longkv.caches.quest import QuestConfig, QuestRunner
from longkv.caches.streaming import StreamingRunner, stream, streaming_generate, streaming_llm
from longkv.caches.two_level import TwoLevelRunner

__all__ = [
    "BoundedConfig",
    "BoundedRunner",
    "InfLLMConfig",
    "InfLLMRunner",
    "KVMFoldConfig",
    "KVMFoldRunner",
    "QuestConfig",
    "QuestRunner",
    "SnapKVConfig",
    "SnapKVRunner",
    "StreamingRunner",
    "TwoLevelRunner",
    "bounded_fold",
    "bounded_generate",
    "make_runner",
    "run_bounded",
    "stream",
    "streaming_generate",
    "streaming_llm",
]
