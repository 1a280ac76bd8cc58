"""LongKVForCausalLM: pre-LayerNorm blocks over pluggable token mixers, with a carried cache."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from longkv.attention.layers import (
    AttentionLayer,
    BlockSlidingWindowAttention,
    FullAttention,
    SlidingWindowAttention,
)
from longkv.decoding import decode, greedy
from longkv.kvm.layer import KVMAttention
from longkv.models.config import LongKVConfig


@dataclass
class LongKVCache:
    """Each layer's mixer state (KVMState or WindowCache) and the tokens seen so far.

    last_inputs: each layer's normalised input at the last token, (B, d_model), for token shift
    (None in a model without it).
    """

    states: list[Any] = field(default_factory=list)
    last_inputs: list[Tensor | None] = field(default_factory=list)
    seen: int = 0

    def get_seq_length(self) -> int:
        return self.seen


def build_mixer(config: LongKVConfig, kind: str, layer: int) -> AttentionLayer:
    """The token mixer of layer `layer`."""
    shell = config.attention_config(layer)
    if kind == "kvm":  # rotates the kvm.rope_dim channels its state zeroes
        return KVMAttention(replace(shell, rope_dim=None), config.kvm_config())
    if kind == "full":
        return FullAttention(shell)
    if kind == "swa":
        return SlidingWindowAttention(shell, config.swa_window)
    return BlockSlidingWindowAttention(shell, config.bswa_chunk_len, config.bswa_window_chunks)


class MLP(nn.Module):
    """Linear -> ReLU^2 -> Linear."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.relu(self.up(x)).square())


class Block(nn.Module):
    """x + mixer(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: LongKVConfig, kind: str, layer: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model)
        self.mixer = build_mixer(config, kind, layer)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config.d_model, config.mlp_ratio * config.d_model)
        self.token_shift = config.token_shift

    def forward(
        self,
        x: Tensor,
        state: Any = None,
        last: Tensor | None = None,
        v_first: Tensor | None = None,
    ) -> tuple[Tensor, Any, Tensor | None, Tensor]:
        """x (B, T, d_model) -> (x, mixer state, last normalised input (B, d_model) or None, v).

        last: the previous call's normalised last token (token shift; None = start of text);
        v_first: the first layer's values (value residual); v: this layer's own values.
        """
        h = self.norm1(x)
        h_prev = None
        if self.token_shift:
            before = h.new_zeros(h.shape[0], 1, h.shape[2]) if last is None else last[:, None]
            h_prev = torch.cat([before, h[:, :-1]], dim=1)
        mixed, state, v = self.mixer.forward_with_values(h, state, x_prev=h_prev, v_first=v_first)
        x = x + mixed
        last = h[:, -1] if self.token_shift else None
        return x + self.mlp(self.norm2(x)), state, last, v


class LongKVForCausalLM(PreTrainedModel):
    """Decoder-only LM; `forward(input_ids, cache)` continues a sequence from any cut."""

    config_class = LongKVConfig
    base_model_prefix = "longkv"
    _no_split_modules: ClassVar[list[str]] = ["Block"]

    def __init__(self, config: LongKVConfig) -> None:
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(
            Block(config, kind, layer) for layer, kind in enumerate(config.mixers)
        )
        self.norm = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(
        self,
        input_ids: Tensor,
        cache: LongKVCache | None = None,
        labels: Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """input_ids (B, T) continuing `cache` (None starts) -> logits (B, T, V), new cache.

        labels (B, T): next-token loss over positions 1..T-1 (labels shifted inside).
        """
        n = len(self.blocks)
        states = cache.states if cache is not None else [None] * n
        lasts = cache.last_inputs if cache is not None else [None] * n
        x = self.embed(input_ids)  # (B, T, d_model)
        new_states, new_lasts = [], []
        v_first: Tensor | None = None
        for block, state, last in zip(self.blocks, states, lasts, strict=True):
            x, state, last, v = block(x, state, last, v_first)
            v_first = v if v_first is None else v_first
            new_states.append(state)
            new_lasts.append(last)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            wide = torch.promote_types(logits.dtype, torch.float32)  # bf16 logits: fp32 loss
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).to(wide), labels[:, 1:].flatten(), ignore_index=-100
            )
        seen = (cache.seen if cache is not None else 0) + input_ids.shape[1]
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=LongKVCache(states=new_states, last_inputs=new_lasts, seen=seen),
        )

    @torch.no_grad()
    def generate(  # type: ignore[override]
        self,
        input_ids: Tensor,
        max_new_tokens: int = 32,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
        use_cache: bool = True,
    ) -> Tensor:
        """Prompts (B, T) of equal length followed by up to max_new_tokens tokens each.

        Greedy, or sampling at `temperature` from the top_k tokens (all when None). With
        use_cache=False every step recomputes from scratch (the reference the cache must match).
        A row that emitted eos_token_id keeps emitting it; generation stops when all have.
        """
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature: must be > 0 when sampling, got {temperature}")
        out = self(input_ids)
        cache, tokens = out.cache, input_ids

        def step(ids: Tensor) -> Tensor:  # (B, 1) -> logits (B, V)
            nonlocal cache, tokens
            tokens = torch.cat([tokens, ids], dim=1)
            out = self(ids, cache=cache) if use_cache else self(tokens)
            cache = out.cache
            return out.logits[:, -1]

        def sample(logits: Tensor) -> Tensor:
            scaled = logits.double() / temperature
            if top_k is not None:
                kth = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            return torch.multinomial(scaled.softmax(-1), 1, generator=generator)[:, 0]

        new = decode(
            step, out.logits[:, -1], max_new_tokens,
            pick=sample if do_sample else greedy, eos_token_id=eos_token_id,
        )  # fmt: skip
        return torch.cat([input_ids, new], dim=1)


AutoConfig.register("longkv", LongKVConfig)
AutoModelForCausalLM.register(LongKVConfig, LongKVForCausalLM)
