"""Attention layers: projections, qk LayerNorm and partial RoPE around a functional core.

`AttentionLayer` holds what every layer shares; subclasses say how queries mix with keys and
values (`mix`). Every layer maps x (B, T, d_model) and an optional state to (y, state), so a
sequence can be fed in any segmentation, with positions continuing from `state.seen`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from longkv.attention.functional import (
    block_sliding_window_attention,
    check_blocks,
    check_window,
    full_attention,
    sliding_window_attention,
)
from longkv.attention.rope import apply_rope
from longkv.attention.state import WindowCache
from longkv.checks import require, require_at_least

S = TypeVar("S")


def in_state_precision(
    q: Tensor, attend: Callable[[Callable[[Tensor | None], Tensor | None]], tuple[Tensor, S]]
) -> tuple[Tensor, S]:
    """Run a state-carrying attention in at least float32 with autocast off, so that its state
    (sums, counts, norms) stays float32 under bf16 autocast or bf16 parameters (in bf16 a count
    stops at 256 and a sum of many keys loses their differences). attend(wide) receives the
    cast to use on its tensors (None passes through) and returns (out, state); out comes back
    in q's dtype. The casts pass gradients back."""
    dtype = torch.promote_types(q.dtype, torch.float32)

    def wide(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(dtype)

    with torch.autocast(q.device.type, enabled=False):
        out, state = attend(wide)
    return out.to(q.dtype), state


@dataclass(frozen=True)
class AttentionConfig:
    """The shell of an attention layer.

    n_kv_heads None = n_heads (no grouping); head_dim None = d_model // n_heads;
    rope_dim None = the whole head (KV-Means layers take it from their KVMConfig instead).
    token_shift: keys and values are projected from x_t + mu * (x_{t-1} - x_t), mu learned per
    channel (init 0.5; x_{-1} = 0). value_residual: values become v + lam * (v_first - v), with
    v_first the first layer's values and lam = sigmoid(a) learned per KV head (init 0.5), or
    with value_residual_rank r > 0 per channel, lam = sigmoid(v0 + x A B) through a rank-r gate
    of the layer's input x (the KVM paper's; v0 falls from 0.93 to 0.53 across the channels).
    """

    d_model: int
    n_heads: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    rope_dim: int | None = None
    rope_base: float = 10000.0
    qk_norm: bool = True
    bias: bool = False
    token_shift: bool = False
    value_residual: bool = False
    value_residual_rank: int = 0

    def __post_init__(self) -> None:
        require_at_least(1, self, "d_model", "n_heads")
        require_at_least(0, self, "value_residual_rank")
        require(
            self.kv_heads >= 1 and self.n_heads % self.kv_heads == 0,
            self,
            "n_kv_heads",
            f"must divide n_heads = {self.n_heads}, got {self.n_kv_heads}",
        )
        require(
            self.head_dim is not None or self.d_model % self.n_heads == 0,
            self,
            "head_dim",
            f"is None but n_heads = {self.n_heads} does not divide d_model = {self.d_model}; "
            "set head_dim explicitly",
        )
        require(self.dim >= 1, self, "head_dim", f"must be >= 1, got {self.head_dim}")
        require(
            self.rotary == 0 or (0 < self.rotary <= self.dim and self.rotary % 2 == 0),
            self,
            "rope_dim",
            f"must be an even number in [0, head_dim = {self.dim}], got {self.rope_dim}",
        )
        require(self.rope_base > 0, self, "rope_base", f"must be > 0, got {self.rope_base}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def dim(self) -> int:
        """Per-head dimension of queries, keys and values."""
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    @property
    def rotary(self) -> int:
        """Channels per head that carry RoPE."""
        return self.dim if self.rope_dim is None else self.rope_dim


class AttentionLayer(nn.Module):
    """Projections, optional qk LayerNorm, partial RoPE and output projection."""

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__()
        self.config = config
        H, Hkv, D = config.n_heads, config.kv_heads, config.dim
        self.q_proj = nn.Linear(config.d_model, H * D, bias=config.bias)
        self.k_proj = nn.Linear(config.d_model, Hkv * D, bias=config.bias)
        self.v_proj = nn.Linear(config.d_model, Hkv * D, bias=config.bias)
        self.o_proj = nn.Linear(H * D, config.d_model, bias=config.bias)
        self.q_norm = nn.LayerNorm(D) if config.qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(D) if config.qk_norm else nn.Identity()
        shift = config.token_shift
        self.shift_k = nn.Parameter(torch.full((config.d_model,), 0.5)) if shift else None
        self.shift_v = nn.Parameter(torch.full((config.d_model,), 0.5)) if shift else None
        self.value_mix: nn.Parameter | None = None  # a per KV head, or v0 per channel
        self.value_gate: nn.Sequential | None = None  # x -> x A B, rank value_residual_rank
        if config.value_residual and config.value_residual_rank:
            channel = torch.linspace(0, 1, Hkv * D)
            self.value_mix = nn.Parameter(0.73 - 0.4 * (channel - 0.5))
            r = config.value_residual_rank
            linears = nn.Linear(config.d_model, r, bias=False), nn.Linear(r, Hkv * D, bias=False)
            self.value_gate = nn.Sequential(*linears)
        elif config.value_residual:
            self.value_mix = nn.Parameter(torch.zeros(Hkv))

    def project(
        self, x: Tensor, start: int, x_prev: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, d_model) at positions start.. -> q (B, H, T, D), k, v (B, Hkv, T, D).

        x_prev (B, T, d_model): the input one token earlier (token_shift layers only).
        """
        c = self.config
        B, T, _ = x.shape
        x_k = x_v = x
        if self.shift_k is not None and self.shift_v is not None:
            if x_prev is None or x_prev.shape != x.shape:
                raise ValueError(
                    "x_prev: a token_shift layer needs the input one token earlier, shaped like "
                    f"x {tuple(x.shape)}; got {None if x_prev is None else tuple(x_prev.shape)}"
                )
            x_k = x + self.shift_k * (x_prev - x)
            x_v = x + self.shift_v * (x_prev - x)
        q = self.q_norm(self.q_proj(x).view(B, T, c.n_heads, c.dim).transpose(1, 2))
        k = self.k_norm(self.k_proj(x_k).view(B, T, c.kv_heads, c.dim).transpose(1, 2))
        v = self.v_proj(x_v).view(B, T, c.kv_heads, c.dim).transpose(1, 2)
        pos = torch.arange(start, start + T, device=x.device)
        return (
            apply_rope(q, pos, c.rotary, c.rope_base),
            apply_rope(k, pos, c.rotary, c.rope_base),
            v,
        )

    def mix(
        self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, state: Any, donate: bool = False
    ) -> tuple[Tensor, Any]:
        """The attention proper: (out (B, H, T, D), state); donate: the given state may be
        changed in place (its holder keeps only the returned one)."""
        raise NotImplementedError

    def forward(self, x: Tensor, state: Any = None) -> tuple[Tensor, Any]:
        """x (B, T, d_model), state from the previous call or None -> (y (B, T, d_model), state)."""
        y, state, _ = self.forward_with_values(x, state)
        return y, state

    def forward_with_values(
        self,
        x: Tensor,
        state: Any = None,
        *,
        x_prev: Tensor | None = None,
        v_first: Tensor | None = None,
        donate: bool = False,
    ) -> tuple[Tensor, Any, Tensor]:
        """`forward` with token shift and value residual: -> (y, state, v (B, Hkv, T, D)).

        x_prev (B, T, d_model): the input one token earlier (token_shift); v_first: the first
        layer's values (value_residual); v: this layer's own values, before the residual;
        donate: the given state may be changed in place (see `mix`).
        """
        if x.dim() != 3 or x.shape[-1] != self.config.d_model:
            raise ValueError(
                f"x: expected (batch, tokens, d_model={self.config.d_model}), got {tuple(x.shape)}"
            )
        q, k, v = self.project(x, 0 if state is None else state.seen, x_prev)
        mixed_v = v
        if self.value_mix is not None:
            if v_first is None or v_first.shape != v.shape:
                raise ValueError(
                    "v_first: a value_residual layer needs the first layer's values, shaped like "
                    f"{tuple(v.shape)}; got {None if v_first is None else tuple(v_first.shape)}"
                )
            if self.value_gate is None:  # per KV head
                lam = torch.sigmoid(self.value_mix).view(1, -1, 1, 1).to(v.dtype)  # autocast: v's
            else:  # per channel, (B, T, Hkv * D) -> (B, Hkv, T, D)
                gate = torch.sigmoid(self.value_mix + self.value_gate(x)).to(v.dtype)
                lam = gate.view(*x.shape[:2], *v.shape[1::2]).transpose(1, 2)
            mixed_v = v + lam * (v_first - v)
        out, state = self.mix(q, k, mixed_v, x, state, donate)
        B, T, _ = x.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), state, v


class FullAttention(AttentionLayer):
    """Causal softmax attention over every earlier token (the cache grows with the sequence)."""

    def mix(
        self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, state: WindowCache | None,
        donate: bool = False,
    ) -> tuple[Tensor, WindowCache]:  # fmt: skip
        return full_attention(q, k, v, state=state, donate=donate)


class SlidingWindowAttention(AttentionLayer):
    """SWA: each query sees its `window` most recent tokens."""

    def __init__(self, config: AttentionConfig, window: int) -> None:
        super().__init__(config)
        check_window(window)
        self.window = window

    def mix(
        self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, state: WindowCache | None,
        donate: bool = False,
    ) -> tuple[Tensor, WindowCache]:  # fmt: skip
        return sliding_window_attention(q, k, v, self.window, state=state, donate=donate)


class BlockSlidingWindowAttention(AttentionLayer):
    """BSWA: a query in chunk c sees chunks c - N + 1 .. c (up to itself)."""

    def __init__(self, config: AttentionConfig, chunk_len: int, window_chunks: int) -> None:
        super().__init__(config)
        check_blocks(chunk_len, window_chunks)
        self.chunk_len, self.window_chunks = chunk_len, window_chunks

    def mix(
        self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, state: WindowCache | None,
        donate: bool = False,
    ) -> tuple[Tensor, WindowCache]:  # fmt: skip
        return block_sliding_window_attention(
            q, k, v, self.chunk_len, self.window_chunks, state=state, donate=donate
        )
