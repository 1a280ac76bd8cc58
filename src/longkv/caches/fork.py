"""A runner forked: a copy that reads on from where the runner stands and leaves it as it was.

A read of a long input (a `FoldRunner` of the fold or full attention, a `BoundedRunner`) is
asked many questions, each continuing from it. `fork` copies what a continuation changes in
place (the bounded part: sinks, middle, window and a KVM state's slots, a longkv model's KVM
states) and shares the rest, which a continuation never writes: the model, the keys and values
of a transformers cache (each forward concatenates them into new tensors) and the leaves of a
retrieval cache (`LeafStore.fork`: read-only below their end, the fork's own leaves after it).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicCache

from longkv.caches.bounded import BoundedRunner
from longkv.caches.retrieval import RetrievalRunner
from longkv.fold.fold import FoldRunner


def fork(runner: FoldRunner | BoundedRunner) -> FoldRunner | BoundedRunner:
    """A copy of the runner sharing the model, the cache's keys and values and the leaves; one
    fork of a runner at a time may read (forks append leaves in one shared buffer)."""
    model = runner.model
    memo: dict[int, object] = {id(m): m for m in model.modules()}
    memo.update((id(t), t) for t in (*model.parameters(), *model.buffers()))
    if isinstance(runner.cache, DynamicCache):
        for layer in runner.cache.layers:
            memo.update((id(t), t) for t in vars(layer).values() if isinstance(t, torch.Tensor))
    if isinstance(runner, RetrievalRunner):
        memo.update((id(s), s.fork()) for s in runner.leaves if s is not None)
    with torch.inference_mode():
        return copy.deepcopy(runner, memo)
