"""InfLLM (Xiao et al. 2024, arXiv 2402.04617): a training-free context memory. The tokens that
leave the local window form blocks of `block` contiguous tokens; a block is represented by the
keys of the `representatives` tokens that received the most attention while they were in the
window; the queries of a chunk (a decoded token) retrieve the `open` blocks whose
representatives best match their mean query, one choice per layer shared by all heads, and
attend them beside the initial tokens, the newest, not yet full block and the local window.

Positions are InfLLM's: the memory (initial tokens, blocks, the partial block) is kept without
RoPE and the query meets it rotated at window - 1, so that every memory token sits at one
distance inside the trained range, while the local window keeps the positions the model gave it
(or, with `positions="inside"`, takes its cache index, `longkv.caches.retrieval`, so that the
input may run past the model's positions).

In longkv InfLLM is a retrieval cache (`longkv.caches.retrieval`): its units are the blocks,
its initial tokens the sinks, its local window the window (both those of two-level KVM-Fold at
the same budget), read in the command's chunks (InfLLM: 512). Per query head a block's
representative key is the mean of the un-rotated keys of its `representatives` most attended
tokens; a block's score is sum over heads of the chunk's mean memory query . that head's
representative; while there are no more full blocks than `open`, all are opened.
Departures from the reference (thunlp/InfLLM, `inf_llm/attention/context_manager.py`):
- the window is chunk-aligned, as in every bounded cache here (a chunk's queries see the whole
  window before the chunk and the chunk up to themselves), so no token is attended twice: the
  reference's chunked prefill also attends up to chunk - 1 of the newest memory tokens in both
  its local part and its global part;
- attention received is summed in float32 (the reference: the model's dtype, bf16 there), and
  the prompt's last token is read in its last chunk (the reference reads it as a decoding step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from longkv.attention.core import KeySet, attend_key_sets_lse, hidden_future
from longkv.attention.state import tensor_bytes
from longkv.caches.bounded import BoundedConfig
from longkv.caches.leaves import Gathered
from longkv.caches.retrieval import RetrievalRunner
from longkv.caches.routed import POSITIONS, Part, attended_entries, grouped, top_units
from longkv.checks import require, require_at_least, setting
from longkv.fold.attention import Attend


@dataclass(frozen=True)
class InfLLMConfig(BoundedConfig):
    """InfLLM's memory: initial tokens (the sinks), a local window and blocks of the tokens that
    left it, retrieved by representative keys."""

    block: int = setting(128, "tokens per memory block (InfLLM: 128)")
    representatives: int = setting(4, "tokens per block whose keys represent it (InfLLM: 4)")
    open: int = setting(8, "blocks each chunk of queries (each decoded token) retrieves per layer")
    positions: str = setting(
        "exact",
        "where the local window is placed (the memory is met at window - 1 either way): exact "
        "(at the positions the model gave it; refused past the model's positions) or inside "
        "(at its cache index: no distance past the budget, at any length)",
        choices=POSITIONS,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least(1, self, "block", "representatives", "open")
        require(self.positions in POSITIONS, self, "positions", f"must be one of {POSITIONS}")

    def describe(self) -> str:
        return (
            f"{self.sinks} initial + {self.window_len} local tokens + blocks of {self.block} "
            f"({self.representatives} representatives), {self.open} retrieved per layer; "
            f"memory un-rotated, met at distance {self.window_len - 1}"
            + ("; window at its cache index" if self.positions == "inside" else "")
        )


def representatives(keys: Tensor, scores: Tensor, r: int) -> Tensor:
    """(B, H, D): per query head the mean of the keys of the r tokens with the highest scores
    (the earlier on ties); keys (B, Hkv, n, D), scores (B, H, n) with H a multiple of Hkv."""
    chosen = top_units(scores, r).to(keys.dtype)  # (B, H, n)
    groups = scores.shape[1] // keys.shape[1]
    summed = (chosen.unsqueeze(2) @ keys.repeat_interleave(groups, dim=1))[:, :, 0]
    return summed / chosen.sum(-1, keepdim=True)


def block_scores(q_mem: Tensor, reps: Tensor) -> Tensor:
    """(B, U): sum over heads of the mean of the memory queries q_mem (B, H, L, D) and each
    block's representative for that head, reps (B, H, U, D)."""
    return (reps @ q_mem.mean(2).unsqueeze(-1))[..., 0].sum(1)


class InfLLMRunner(RetrievalRunner):
    """InfLLM's blocks over the tokens that left the window; per layer the attention each
    window token has received, the newest tokens not yet in a full block, and every full
    block's representatives."""

    method = "InfLLM"
    KV_FIELDS = ("reps",)
    config: InfLLMConfig

    def __init__(self, model: nn.Module, config: InfLLMConfig):
        super().__init__(model, config)
        layers = model.config.num_hidden_layers
        # per layer: attention received (B, H, n) by the window's tokens, then the chunk's
        self.received: list[Tensor | None] = [None] * layers
        # per layer: the newest memory tokens, not yet a full block: attention received
        # (B, H, r) and un-rotated keys (B, Hkv, r, D)
        self.pending: list[tuple[Tensor, Tensor] | None] = [None] * layers
        # per layer: each full block's representative key per query head (B, H, U, D)
        self.reps: list[Tensor | None] = [None] * layers

    def absorb(self, layer: int, keys: Tensor, values: Tensor, first: int) -> None:
        """The oldest window tokens (keys as the model rotated them) join the memory without
        their rotation; every block they fill gets its representatives."""
        m, block, r = keys.shape[2], self.config.block, self.config.representatives
        plain = self.plain_keys(layer, keys, first)
        store = self.leaves[layer]
        n = 0 if store is None else len(store)
        unit = torch.arange(n, n + m, device=keys.device) // block
        self.keep_leaves(layer, plain, values, unit.expand(*keys.shape[:2], m))
        received = self.received[layer]
        assert received is not None
        got, self.received[layer] = received[:, :, :m], received[:, :, m:]
        held = self.pending[layer]
        scores, waiting = (got, plain) if held is None else (
            torch.cat([held[0], got], dim=2), torch.cat([held[1], plain], dim=2)
        )  # fmt: skip
        full = scores.shape[2] // block
        if full:
            each = scores[:, :, : full * block].unflatten(2, (full, block)).transpose(1, 2)
            ks = waiting[:, :, : full * block].unflatten(2, (full, block)).transpose(1, 2)
            new = representatives(ks.flatten(0, 1), each.flatten(0, 1), r)  # (B * full, H, D)
            new = new.unflatten(0, (-1, full)).transpose(1, 2)  # (B, H, full, D)
            reps = self.reps[layer]
            self.reps[layer] = new if reps is None else torch.cat([reps, new], dim=2)
        self.pending[layer] = (scores[:, :, full * block :], waiting[:, :, full * block :])

    def attend(self, layer: int) -> Attend:
        """This layer's attention: the chunk's memory queries (rotated at window - 1) choose the
        blocks (`block_scores`) and attend the un-rotated initial tokens, the chosen blocks and
        the partial one; the queries at their own positions attend the window; one softmax.
        Keeps the attention the window and chunk tokens received (`received`)."""
        config, first = self.config, self.seen
        parts = self.parts(layer) if self.seen else None

        def attend(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
            B, H, L, D = q.shape
            Hkv = keys.shape[1]
            nothing = (Part(keys[:, :, :0], values[:, :, :0]),) * 3  # the first chunk's
            sinks, _, recent = nothing if parts is None else parts
            to_sinks = min(max(config.sinks - first, 0), L)  # the chunk's tokens that become sinks
            G, high = H // Hkv, torch.promote_types(q.dtype, torch.float32)
            q_mem = self.memory_query(layer, q).to(high)  # each query at window - 1
            q_g = (grouped(q.to(high), Hkv) * scale).view(B, Hkv, G, L, D)
            memory_k = self.unrotated(layer, sinks.keys, 0).to(high)
            memory_v = sinks.values.to(high)
            opened, count, got = self.retrieve(layer, q_mem)
            if got is not None:
                memory_k = torch.cat([memory_k, got.keys], dim=2)
                memory_v = torch.cat([memory_v, got.values], dim=2)
            window_k, window_v = recent.keys.to(high), recent.values.to(high)
            chunk_k = keys.to(high)
            sets = [
                KeySet(q_g, window_k, window_v),
                KeySet(q_g, chunk_k, values.to(high), causal=True),
            ]
            if memory_k.shape[2]:
                mem_q = (grouped(q_mem, Hkv) * scale).view(B, Hkv, G, L, D)
                sets.append(KeySet(mem_q, memory_k, memory_v))
            out, lse = attend_key_sets_lse([s for s in sets if s.k.shape[2]])
            W = window_k.shape[2]
            self.receive(layer, q_g, torch.cat([window_k, chunk_k], dim=2), lse, W, to_sinks)
            self.tally(attended_entries(opened, count, sinks.keys.shape[2], W, L, False))
            return out.reshape(B, H, L, -1).to(q.dtype)

        return attend

    def retrieve(self, layer: int, q_mem: Tensor) -> tuple[Tensor, Tensor, Gathered | None]:
        """The blocks the memory queries q_mem (B, H, L, D) open together, (B, 1, 1, U) bool:
        the `open` best full ones (`block_scores`) and the newest while not full; each block's
        tokens (B, 1, U); their leaves (None: no memory yet)."""
        store, reps, config = self.leaves[layer], self.reps[layer], self.config
        B, H = q_mem.shape[:2]
        U = 0 if store is None else -(-len(store) // config.block)
        opened = torch.zeros(B, 1, 1, U, dtype=torch.bool, device=q_mem.device)
        count = torch.full((B, 1, U), float(config.block), device=q_mem.device)
        if store is None or not U:
            return opened, count, None
        count[..., -1] = len(store) - (U - 1) * config.block
        full = 0 if reps is None else reps.shape[2]
        score = q_mem.new_full((B, U), float("inf"))  # the newest block, not yet full
        if reps is not None:
            score[:, :full] = block_scores(q_mem, reps.to(q_mem.dtype))
        opened[:, 0, 0] = top_units(score, config.open + U - full)
        Hkv = store.owner.tensor.shape[1]
        shared = (B, Hkv, 1, U)  # one row for every query head and query
        G, L = H // Hkv, q_mem.shape[2]
        self.remember(layer, score[:, None, None].expand(shared), opened.expand(shared), G, L)
        return opened, count, store.gather(opened[:, 0].expand(B, Hkv, U), q_mem.dtype)

    def receive(
        self, layer: int, q: Tensor, local_k: Tensor, lse: Tensor, W: int, to_sinks: int
    ) -> None:  # fmt: skip
        """Add the attention the window's W tokens and the chunk's (all but those that become
        sinks) received from the chunk's queries q (B, Hkv, G, L, D, scaled) to `received`,
        per query head: their probabilities under the layer's softmax, whose log-normaliser
        is lse (B, Hkv, G * L)."""
        B, Hkv, G, L, _ = q.shape
        logits = q.reshape(B, Hkv, G * L, -1) @ local_k.transpose(-1, -2)  # (B, Hkv, G*L, W+L)
        logits[..., W:] = logits[..., W:].masked_fill(
            hidden_future(L, q.device).repeat(G, 1), float("-inf")
        )
        mass = (logits - lse.unsqueeze(-1)).exp().view(B, Hkv, G, L, -1).sum(3)
        mass = mass.reshape(B, Hkv * G, -1).float()  # (B, H, W + L)
        held = self.received[layer]
        old = mass[:, :, :W] if held is None else held + mass[:, :, :W]
        self.received[layer] = torch.cat([old, mass[:, :, W + to_sinks :]], dim=2)

    def routes(self) -> bool:
        """InfLLM's attention from the first chunk on: the window's tokens need the attention
        they receive before any of them leaves."""
        return True

    def middle_bytes(self) -> int:
        """The attention received, the newest memory tokens and the representatives."""
        held = [*self.received, *self.reps, *(t for p in self.pending if p for t in p)]
        return tensor_bytes(*(t for t in held if t is not None))
