"""KV-Fold: a frozen causal LM run over a long input chunk by chunk (spec kvfold.md section 1).

The KV cache is the accumulator of a left fold over chunks: each chunk's queries attend to the
cache of every earlier chunk plus their own causal prefix, at absolute positions that continue
across chunk boundaries. Mathematically this is one full causal forward; the fold only bounds
the activations held at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm
from transformers.cache_utils import Cache

from longkv.bench.memory import peak_memory
from longkv.fold import compat


@dataclass
class FoldResult:
    """What a fold returns.

    nll: (B, T - 1) float32 NLL of tokens 1..T-1, each scored once (the first token of a chunk by
    the last logit of the one before); cache: the folded cache, to continue generating;
    last_logits: (B, V) logits after the last token; chunk_seconds: wall time per chunk;
    peak_memory_bytes: the run's peak memory above the level before it (CUDA allocator peak, or
    resident-set rise on CPU; None when not measured); next_position: the position of the next
    token (T plus any earlier cache and inserted prefixes); logits: (B, T, V) when asked for.
    """

    nll: Tensor
    cache: Cache
    last_logits: Tensor
    chunk_size: int
    next_position: int
    chunk_seconds: list[float] = field(default_factory=list)
    peak_memory_bytes: int | None = None
    logits: Tensor | None = None

    @property
    def seconds(self) -> float:
        """Total wall time of the chunks."""
        return sum(self.chunk_seconds)

    def chunk_nll(self) -> Tensor:
        """(n_chunks,) mean NLL of each chunk's scored tokens over the batch (not token 0)."""
        padded = torch.cat([self.nll.new_full((self.nll.shape[0], 1), float("nan")), self.nll], 1)
        chunks = padded.split(self.chunk_size, dim=1)
        return torch.stack([c.nanmean() for c in chunks])


def check_foldable(model: nn.Module, T: int, *, allow_extrapolation: bool = False) -> None:
    """Raise ValueError if the model cannot be folded correctly over T tokens."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"model: {type(model).__name__} is an encoder-decoder; KV-Fold needs a causal LM "
            "(AutoModelForCausalLM)"
        )
    if not compat.accepts_cache(model):
        raise ValueError(
            f"model: {type(model).__name__}.forward takes no `{compat.CACHE_ARG}` and "
            "`position_ids`; KV-Fold needs a model that uses the transformers cache API"
        )
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None or T <= limit:
        return
    learned = getattr(config, "model_type", "") in {"gpt2", "gpt_neo", "gptj", "opt", "bloom"}
    if learned or not allow_extrapolation:
        why = (
            "its learned position embeddings stop there"
            if learned
            else "positions past it were never trained; pass allow_extrapolation=True to run anyway"
        )
        raise ValueError(
            f"input_ids: {T} tokens exceed the model's max_position_embeddings = {limit}; {why}"
        )


def _positions(start: int, length: int, batch: int, device: torch.device) -> Tensor:
    return torch.arange(start, start + length, device=device).expand(batch, length)


def kv_fold(
    model: nn.Module,
    input_ids: Tensor,
    chunk_size: int,
    *,
    prefix_ids: Tensor | None = None,
    cache: Cache | None = None,
    return_logits: bool = False,
    measure_memory: bool = True,
    allow_extrapolation: bool = False,
    progress: bool = False,
) -> FoldResult:
    """Fold `model` over input_ids (B, T) in chunks of chunk_size tokens.

    prefix_ids: (P,) token ids inserted before every chunk (e.g. the BOS), a structural
    perturbation: they enter the cache and take positions, so the model sees
    [prefix, chunk 0, prefix, chunk 1, ...]; only the input tokens are scored.
    cache: continue an earlier fold (its length is the position of input_ids[:, 0]).
    """
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(
            f"input_ids: expected (batch, tokens) with tokens >= 1, got {tuple(input_ids.shape)}"
        )
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: must be an int >= 1, got {chunk_size!r}")
    B, T = input_ids.shape
    device = input_ids.device
    prefix = input_ids.new_zeros(0) if prefix_ids is None else prefix_ids.to(device).view(-1)
    P = prefix.numel()
    n_chunks = -(-T // chunk_size)
    cache = compat.new_cache(model) if cache is None else cache
    start = cache.get_seq_length()
    check_foldable(model, start + T + P * n_chunks, allow_extrapolation=allow_extrapolation)

    def run() -> FoldResult:
        nll = torch.empty(B, T - 1, dtype=torch.float32, device=device)
        kept: list[Tensor] = []
        seconds: list[float] = []
        prev_last: Tensor | None = None
        pos = start
        with torch.inference_mode():
            for t in tqdm(range(n_chunks), desc="fold", unit="chunk", disable=not progress):
                t0 = time.perf_counter()
                chunk = input_ids[:, t * chunk_size : (t + 1) * chunk_size]
                L = chunk.shape[1]
                ids = torch.cat([prefix.expand(B, P), chunk], dim=1)
                logits = compat.forward(model, ids, _positions(pos, P + L, B, device), cache)
                pos += P + L
                if P:  # the logit before chunk token j is at P - 1 + j
                    pred, first = logits[:, P - 1 : P - 1 + L], 0
                elif prev_last is not None:  # chunk token 0 is scored by the last chunk
                    pred, first = torch.cat([prev_last[:, None], logits[:, : L - 1]], dim=1), 0
                else:
                    pred, first = logits[:, : L - 1], 1
                if t == 0 and first == 0:  # token 0 of the input is never scored
                    pred, first = pred[:, 1:], 1
                g = t * chunk_size + first  # absolute index of the first scored token
                token_nll = F.cross_entropy(
                    pred.float().transpose(1, 2), chunk[:, first:], reduction="none"
                )
                nll[:, g - 1 : g - 1 + token_nll.shape[1]] = token_nll
                prev_last = logits[:, -1]
                if return_logits:
                    kept.append(logits[:, P:])
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds.append(time.perf_counter() - t0)
        assert prev_last is not None
        return FoldResult(
            nll=nll,
            cache=cache,
            last_logits=prev_last,
            chunk_size=chunk_size,
            next_position=pos,
            chunk_seconds=seconds,
            logits=torch.cat(kept, dim=1) if return_logits else None,
        )

    if not measure_memory:
        return run()
    result, peak = peak_memory(run, device)
    result.peak_memory_bytes = peak
    return result
