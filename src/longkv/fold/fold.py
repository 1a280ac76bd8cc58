"""KV-Fold: a frozen causal LM run over a long input chunk by chunk (spec kvfold.md section 1).

The KV cache is the accumulator of a left fold over chunks: each chunk's queries attend to the
cache of every earlier chunk plus their own causal prefix, at absolute positions that continue
across chunk boundaries. Mathematically this is one full causal forward; the fold only bounds
the activations held at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn
from tqdm import tqdm
from transformers.cache_utils import Cache

from longkv.checks import refuse
from longkv.fold import compat
from longkv.fold.attention import hooked
from longkv.fold.variants import check_variant, inserted_positions, variant_hooks
from longkv.nll import token_nll

Forward = Callable[[Tensor], Tensor]  # token ids (B, L) -> logits (B, L, V), advancing a cache


@dataclass
class FoldResult:
    """What a fold (or a streaming run) returns.

    nll: (B, T - 1) NLL of tokens 1..T-1 (float32; float64 for a float64 model), each scored once
    (the first token of a chunk by the last logit of the one before); cache: the cache after the
    run, to continue generating; last_logits: (B, V) logits after the last token;
    next_position: the position the next token takes; chunk_seconds: wall time per chunk;
    logits: (B, T, V) when asked for. Peak memory is measured outside, by `longkv.bench`.
    """

    nll: Tensor
    cache: Cache
    last_logits: Tensor
    chunk_size: int
    next_position: int
    chunk_seconds: list[float] = field(default_factory=list)
    logits: Tensor | None = None

    @property
    def seconds(self) -> float:
        """Total wall time of the chunks."""
        return sum(self.chunk_seconds)

    def chunk_nll(self) -> Tensor:
        """(n_chunks,) mean NLL of each chunk's scored tokens over the batch (not token 0)."""
        return chunk_means(self.nll, self.chunk_size)


def chunk_means(nll: Tensor, chunk_size: int) -> Tensor:
    """Mean of token NLL (B, T - 1) (tokens 1..T-1) per chunk of chunk_size input tokens."""
    padded = torch.cat([nll.new_full((nll.shape[0], 1), float("nan")), nll], dim=1)
    return torch.stack([c.nanmean() for c in padded.split(chunk_size, dim=1)])


class FoldRunner:
    """The fold's accumulator: a cache and the absolute position of the next token.

    variant: a departure from the exact fold (`longkv.fold.variants`) that the runner makes:
    'restart' (positions taken mod chunk_size), or one that runs longkv's attention
    (`variant_hooks`); 'bos' is a prefix, inserted by `score_chunks`.
    cache_dtype, capacity: a new cache's full-attention layers packed in this dtype, for this
    many tokens (`compat.new_cache`; None: transformers' own layers).
    """

    KV_FIELDS: ClassVar[tuple[str, ...]] = ("cache",)  # keys and values (`BoundedRunner`'s)

    def __init__(
        self,
        model: nn.Module,
        cache: Cache | None = None,
        position: int | None = None,
        offload: bool = False,
        variant: str = "exact",
        chunk_size: int | None = None,
        cache_dtype: torch.dtype | None = None,
        capacity: int = 0,
    ):
        check_variant(variant, model)
        if variant == "restart" and chunk_size is None:
            raise ValueError("chunk_size: the 'restart' variant restarts positions every chunk")
        self.model = model
        if cache is None:
            cache = compat.new_cache(model, offload, cache_dtype, capacity)
        self.cache = cache
        self.position = self.cache.get_seq_length() if position is None else position
        self.period = chunk_size if variant == "restart" else None
        self.hooks = variant_hooks(variant)

    def forward(self, ids: Tensor, output: str = "logits") -> Tensor:
        """Logits (B, L, V) of ids (B, L) at the next L positions (or another `output`,
        `compat.OUTPUTS`); the cache grows."""
        B, L = ids.shape
        pos = torch.arange(self.position, self.position + L, device=ids.device).expand(B, L)
        self.position += L
        if self.period is not None:
            pos = pos % self.period
        if self.hooks is None:
            return compat.forward(self.model, ids, pos, self.cache, output)
        with hooked(self.model, self.hooks):
            return compat.forward(self.model, ids, pos, self.cache, output)


def check_foldable(model: nn.Module, T: int, *, allow_extrapolation: bool = False) -> None:
    """Raise ValueError if the model cannot be folded correctly over T positions."""
    found = compat.host(model)
    if not found.causal:
        raise ValueError(
            f"model: {found.name} is an encoder-decoder; KV-Fold needs a causal LM "
            "(AutoModelForCausalLM)"
        )
    if not found.takes_cache:
        raise ValueError(
            f"model: {found.name}.forward takes no `{compat.CACHE_ARG}` and "
            "`position_ids`; KV-Fold needs a model that uses the transformers cache API"
        )
    check_positions(
        model.config, T, "the input, inserted prefixes and tokens to generate",
        allow_extrapolation=allow_extrapolation,
    )  # fmt: skip


# how the command line allows it: the --allow-extrapolation of longkv fold, drift and niah
CLI_SWITCH = "pass --allow-extrapolation"
# The fold's chunk where a caller gives none (`longkv.read`, the commands): measured with
# SmolLM2-135M over 8192 tokens on a 2-core CPU (results/fold_smollm2_8k.md and _c16.md): chunks
# of 1024 read in 24.8 s at a peak of 1164 MiB against one full forward's 27.5 s and 5512 MiB;
# chunks of 16 took 85.9 s at 411 MiB.
FOLD_CHUNK = 1024


def check_positions(
    config: Any,
    T: int,
    what: str,
    *,
    allow_extrapolation: bool = False,
    switch: str = "pass allow_extrapolation=True",
) -> None:
    """Refuse the argument input_ids unless the model of `config` (its `PretrainedConfig`, read
    before or after its weights load) can run T positions (`what` takes them).

    Past its max_position_embeddings only a rotary model (its config has `rope_parameters`)
    runs, and only with allow_extrapolation; `switch` says how to allow it where the refusal
    is read (the Python argument, or CLI_SWITCH).
    """
    limit = getattr(config, "max_position_embeddings", None)
    rotary = getattr(config, "rope_parameters", None) is not None
    if limit is None or T <= limit or (rotary and allow_extrapolation):
        return
    why = (
        f"positions past it were never trained; {switch} to run anyway"
        if rotary
        else "its positions are not rotary (learned, or not known to extrapolate), so "
        "positions past it do not exist"
    )
    refuse(
        None, "input_ids",
        f"{what} take {T} positions and the model has max_position_embeddings = {limit}; {why}",
    )  # fmt: skip


def check_input(input_ids: Tensor, chunk_size: int) -> None:
    """Raise ValueError unless input_ids is (B, T >= 1) and chunk_size an int >= 1."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 1:
        raise ValueError(
            f"input_ids: expected (batch, tokens) with tokens >= 1, got {tuple(input_ids.shape)}"
        )
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: must be an int >= 1, got {chunk_size!r}")


class Runner(Protocol):
    """What carries a sequence between forwards: a cache and the next token's position."""

    model: nn.Module
    cache: Cache

    @property
    def position(self) -> int: ...

    def forward(self, ids: Tensor, output: str = "logits") -> Tensor: ...


# the most positions of one forward whose logits are held at once: a longer forward (full
# attention over a long input) returns its hidden states, turned into logits a block at a time
LOGIT_ROWS = 1024


def chunk_nll(
    model: nn.Module, out: Tensor, hidden: bool, chunk: Tensor, P: int, last: Tensor | None
) -> Tensor:
    """NLL (B, n) of a chunk's tokens (B, L) from its forward's logits (B, P + L, V), or its
    hidden states (`hidden`, turned into logits LOGIT_ROWS at a time): token j is predicted by
    row P - 1 + j, token 0 without a prefix by `last` (B, V), the previous chunk's last logits
    (None: the input's first token, never scored)."""
    L = chunk.shape[1]
    parts: list[Tensor] = []
    first = 0
    if last is None:
        first = 1
    elif P == 0:
        parts.append(token_nll(last[:, None], chunk[:, :1]))
        first = 1
    for a in range(P - 1 + first, P - 1 + L, LOGIT_ROWS):
        b = min(a + LOGIT_ROWS, P - 1 + L)
        rows = compat.head(model, out[:, a:b]) if hidden else out[:, a:b]
        parts.append(token_nll(rows, chunk[:, a - P + 1 : b - P + 1]))
    return torch.cat(parts, dim=1) if parts else chunk.new_zeros(chunk.shape[0], 0).double()


def score_chunks(
    runner: Runner,
    input_ids: Tensor,
    chunk_size: int,
    prefix_ids: Tensor | None = None,
    *,
    return_logits: bool = False,
    score: bool = True,
    progress: bool = False,
    desc: str = "fold",
) -> FoldResult:
    """Feed input_ids (B, T) chunk by chunk through the runner, each chunk after prefix_ids (P,).

    The logit before chunk token j is the last logit of the previous chunk (j = 0, no prefix)
    or the one at position P - 1 + j of this chunk's forward (`chunk_nll`). score=False: a read
    to decode from (nll is empty), whose forwards make no logits but the last chunk's last
    position's (the output layer, a vocabulary wide, runs once per read, not once per chunk).
    """
    B, T = input_ids.shape
    prefix = input_ids.new_zeros(0) if prefix_ids is None else prefix_ids.to(input_ids.device)
    P = prefix.numel()
    scored: list[Tensor] = []  # per chunk (B, L'), in token order
    kept: list[Tensor] = []
    seconds: list[float] = []
    last: Tensor | None = None
    n_chunks = -(-T // chunk_size)
    with torch.inference_mode():
        for t in tqdm(range(n_chunks), desc=desc, unit="chunk", disable=not progress, leave=False):
            t0 = time.perf_counter()
            chunk = input_ids[:, t * chunk_size : (t + 1) * chunk_size]
            L = chunk.shape[1]
            ids = torch.cat([prefix.view(1, P).expand(B, P), chunk], dim=1)
            logits = score or return_logits or t == n_chunks - 1  # a read: its last chunk's
            hidden = (score and P + L > LOGIT_ROWS) or not logits
            output = "hidden" if hidden else "logits" if score or return_logits else "last"
            out = runner.forward(ids, output)
            if score:
                scored.append(chunk_nll(runner.model, out, hidden, chunk, P, last))
            if return_logits:
                kept.append((compat.head(runner.model, out) if hidden else out)[:, P:])
            if logits:  # not a view: the chunk's logits can go
                last = (compat.head(runner.model, out[:, -1:]) if hidden else out)[:, -1].clone()
            if input_ids.device.type == "cuda":
                torch.cuda.synchronize(input_ids.device)
            seconds.append(time.perf_counter() - t0)
    assert last is not None
    return FoldResult(
        nll=torch.cat(scored, dim=1) if score else input_ids.new_zeros(B, 0).double(),
        cache=runner.cache,
        last_logits=last,
        chunk_size=chunk_size,
        next_position=runner.position,
        chunk_seconds=seconds,
        logits=torch.cat(kept, dim=1) if return_logits else None,
    )


def kv_fold(
    model: nn.Module,
    input_ids: Tensor,
    chunk_size: int,
    *,
    prefix_ids: Tensor | None = None,
    cache: Cache | None = None,
    return_logits: bool = False,
    score: bool = True,
    allow_extrapolation: bool = False,
    reserve: int = 0,
    offload_cache: bool = False,
    variant: str = "exact",
    cache_dtype: torch.dtype | None = None,
    room: int = 0,
    progress: bool = False,
) -> FoldResult:
    """Fold `model` over input_ids (B, T) in chunks of chunk_size tokens.

    prefix_ids: (P,) token ids inserted before every chunk (e.g. a chat template), a
    structural perturbation: they enter the cache and take positions, so the model sees
    [prefix, chunk 0, prefix, chunk 1, ...]; only the input tokens are scored.
    variant: a departure from the exact fold, for studying drift (`longkv.fold.variants`;
    'bos' inserts the model's BOS as the prefix).
    cache: continue an earlier fold (its length is the position of input_ids[:, 0]).
    score=False: a read to decode from, whose forwards make their last position's logits alone
    (the result's nll is empty).
    reserve: positions to keep within the model's limit after the input (for generation).
    offload_cache: keep the cache in CPU memory between layers, for contexts larger than the
    accelerator's memory (transformers' offloaded DynamicCache; the model must be on a GPU).
    cache_dtype: a new cache's full-attention layers keep their keys and values in this dtype,
    in storage allocated for the input, `reserve` and `room` more tokens (`longkv.fold.packed`;
    a dtype narrower than the model's rounds them once); None: transformers' layers, in the
    model's dtype. room: tokens a packed cache has storage for past the input and reserve,
    which are not positions the fold checks (a read's later questions, `longkv.read`).
    """
    check_input(input_ids, chunk_size)
    if offload_cache and input_ids.device.type == "cpu":
        raise ValueError(
            "offload_cache: the cache already lives in CPU memory when the model runs on the "
            "CPU; offloading is for a model on an accelerator"
        )
    if prefix_ids is not None and variant != "exact":
        raise ValueError(
            f"prefix_ids: a per-chunk prefix is itself a variant of the fold; pass it with "
            f"variant='exact', not {variant!r}"
        )
    T = input_ids.shape[1]
    inserted = inserted_positions(variant, T, chunk_size)  # 'bos': one per chunk
    if prefix_ids is not None:
        inserted += prefix_ids.numel() * -(-T // chunk_size)
    start = 0 if cache is None else cache.get_seq_length()
    check_foldable(model, start + T + inserted + reserve, allow_extrapolation=allow_extrapolation)
    runner = FoldRunner(
        model, cache, offload=offload_cache, variant=variant, chunk_size=chunk_size,
        cache_dtype=cache_dtype, capacity=start + T + inserted + reserve + room,
    )  # fmt: skip
    if variant == "bos":
        prefix_ids = torch.tensor([model.config.bos_token_id])
    return score_chunks(
        runner, input_ids, chunk_size, prefix_ids,
        return_logits=return_logits, score=score, progress=progress,
    )  # fmt: skip
