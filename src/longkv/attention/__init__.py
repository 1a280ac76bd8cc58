"""Baseline attentions (full causal, SWA, BSWA) with the same state contract as KVM."""

from longkv.attention.functional import (
    block_sliding_window_attention,
    full_attention,
    sliding_window_attention,
)
from longkv.attention.layers import (
    AttentionConfig,
    AttentionLayer,
    BlockSlidingWindowAttention,
    FullAttention,
    SlidingWindowAttention,
)
from longkv.attention.naive import (
    naive_block_sliding_window_attention,
    naive_full_attention,
    naive_sliding_window_attention,
)
from longkv.attention.state import WindowCache
from longkv.vml import warm_up_vml

warm_up_vml()  # before any threaded VML call: see longkv.vml

__all__ = [
    "AttentionConfig",
    "AttentionLayer",
    "BlockSlidingWindowAttention",
    "FullAttention",
    "SlidingWindowAttention",
    "WindowCache",
    "block_sliding_window_attention",
    "full_attention",
    "naive_block_sliding_window_attention",
    "naive_full_attention",
    "naive_sliding_window_attention",
    "sliding_window_attention",
]
