"""RWKV7: the time-mixing block of RWKV-7 "Goose" (Peng et al. 2025, arXiv:2503.14456) as a
longkv token mixer, around `rwkv7_recurrence`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longkv.checks import require_at_least
from longkv.rwkv.functional import rwkv7_recurrence
from longkv.rwkv.state import RWKV7State

SHIFTED = ("r", "w", "k", "v", "a", "g")  # the inputs that each lerp x_t towards x_{t-1}
GROUP_NORM_EPS = 64e-5  # RWKV-7's per-head GroupNorm eps for 64-channel heads


def lora_rank(size: float) -> int:
    """A multiple of 32 near `size`, at least 32 (RWKV-7's rule for its low-rank sizes)."""
    return max(32, 32 * round(size / 32))


@dataclass(frozen=True)
class RWKV7Config:
    """Shape of an RWKV-7 time-mixing layer.

    n_heads heads of head_dim channels (keys and values alike); chunk_len: tokens per chunk of
    `rwkv7_recurrence`; value_residual: mix the first layer's values in (every layer but the
    first). The low-rank sizes follow RWKV-7's rule for d = d_model: decay and in-context
    learning rate ~1.8 sqrt(d), value residual ~1.3 sqrt(d), gate ~0.6 d^0.8, each rounded to
    a multiple of 32, at least 32 (64, 64, 32, 128 for d = 768).
    """

    d_model: int
    n_heads: int
    head_dim: int
    chunk_len: int = 16
    value_residual: bool = False

    def __post_init__(self) -> None:
        require_at_least(1, self, "d_model", "n_heads", "head_dim", "chunk_len")

    @property
    def inner(self) -> int:
        """n_heads * head_dim, the width of r, k, v."""
        return self.n_heads * self.head_dim

    @property
    def decay_rank(self) -> int:
        """Rank of the decay and in-context learning rate LoRAs."""
        return lora_rank(1.8 * math.sqrt(self.d_model))

    @property
    def value_rank(self) -> int:
        """Rank of the value-residual LoRA."""
        return lora_rank(1.3 * math.sqrt(self.d_model))

    @property
    def gate_rank(self) -> int:
        """Rank of the output gate."""
        return lora_rank(0.6 * self.d_model**0.8)


def low_rank(d_in: int, rank: int, d_out: int, act: nn.Module | None = None) -> nn.Sequential:
    """x -> act(x A) B, two bias-free Linears (the model's init gives both N(0, 0.02))."""
    inner = [nn.Linear(d_in, rank, bias=False)] + ([act] if act is not None else [])
    return nn.Sequential(*inner, nn.Linear(rank, d_out, bias=False))


class RWKV7(nn.Module):
    """RWKV-7 time mixing (docs/models.md, "RWKV-7"): x (B, T, d_model) -> y, with a bounded
    state (`RWKV7State`, one Dv x Dk matrix per head).

    Not an `AttentionLayer`: it has no query/key shell, qk LayerNorm or RoPE, and projects
    from six token-shifted inputs. Initialisation (Linears N(0, 0.02) by the model): token
    shift lerps 0.5; w0 spans -6..1 across each head's channels (decays 0.9985..0.64 before
    the LoRA); a0 = v0 = 0 (learning rate and value mix 0.5); k_k = k_a = 1; r_k = 0 (no bonus
    at init); GroupNorm weight 1, bias 0.
    """

    def __init__(self, config: RWKV7Config) -> None:
        super().__init__()
        self.config = c = config
        d, inner, H, D = c.d_model, c.inner, c.n_heads, c.head_dim
        self.shift = nn.Parameter(torch.full((len(SHIFTED), d), 0.5))
        self.receptance = nn.Linear(d, inner, bias=False)
        self.key = nn.Linear(d, inner, bias=False)
        self.value = nn.Linear(d, inner, bias=False)
        self.output = nn.Linear(inner, d, bias=False)
        self.w0 = nn.Parameter(torch.linspace(-6.0, 1.0, D).repeat(H))
        self.w_lora = low_rank(d, c.decay_rank, inner, nn.Tanh())
        self.a0 = nn.Parameter(torch.zeros(inner))
        self.a_lora = low_rank(d, c.decay_rank, inner)
        self.v0 = nn.Parameter(torch.zeros(inner)) if c.value_residual else None
        self.v_lora = low_rank(d, c.value_rank, inner) if c.value_residual else None
        self.gate = low_rank(d, c.gate_rank, inner, nn.Sigmoid())
        self.k_k = nn.Parameter(torch.ones(inner))
        self.k_a = nn.Parameter(torch.ones(inner))
        self.r_k = nn.Parameter(torch.zeros(H, 1, D))
        self.out_norm = nn.GroupNorm(H, inner, eps=GROUP_NORM_EPS)

    def forward(self, x: Tensor, state: RWKV7State | None = None) -> tuple[Tensor, RWKV7State]:
        """x (B, T, d_model), state from the previous call or None -> (y (B, T, d_model), state).

        Only from the start of a text (state None) or with x_prev through `forward_with_values`.
        """
        y, state, _ = self.forward_with_values(x, state)
        return y, state

    def forward_with_values(
        self,
        x: Tensor,
        state: RWKV7State | None = None,
        *,
        x_prev: Tensor | None = None,
        v_first: Tensor | None = None,
        donate: bool = False,
    ) -> tuple[Tensor, RWKV7State, Tensor]:
        """-> (y (B, T, d_model), state, v (B, H, T, head_dim): own values, before the residual).

        x_prev (B, T, d_model): the input one token earlier (None: x shifted by one with zeros
        before, only when state is None); v_first (B, H, T, head_dim): the first layer's values
        (value_residual layers); donate: accepted like the attention layers' (the state is a
        fixed-size matrix, made anew by every call).
        """
        c = self.config
        if x.dim() != 3 or x.shape[-1] != c.d_model:
            raise ValueError(
                f"x: expected (batch, tokens, d_model={c.d_model}), got {tuple(x.shape)}"
            )
        if x_prev is None and state is None:
            x_prev = F.pad(x, (0, 0, 1, -1))
        if x_prev is None or x_prev.shape != x.shape:
            raise ValueError(
                "x_prev: an rwkv7 layer continuing a state needs the input one token earlier, "
                f"shaped like x {tuple(x.shape)}; got "
                f"{None if x_prev is None else tuple(x_prev.shape)}"
            )
        B, T, _ = x.shape

        def heads(t: Tensor) -> Tensor:  # (B, T, H * D) -> (B, H, T, D)
            return t.view(B, T, c.n_heads, c.head_dim).transpose(1, 2)

        x_r, x_w, x_k, x_v, x_a, x_g = (
            x[:, :, None] + self.shift * (x_prev - x)[:, :, None]
        ).unbind(2)
        r, k, v = heads(self.receptance(x_r)), self.key(x_k), heads(self.value(x_v))
        log_w = -math.exp(-0.5) * torch.sigmoid(self.w0 + self.w_lora(x_w))
        iclr = torch.sigmoid(self.a0 + self.a_lora(x_a))
        kappa = F.normalize(heads(k * self.k_k), dim=-1)
        k = heads(k * (1 + (iclr - 1) * self.k_a))
        mixed = v
        if self.v0 is not None and self.v_lora is not None:
            if v_first is None or v_first.shape != v.shape:
                raise ValueError(
                    "v_first: an rwkv7 layer after the first needs the first layer's values, "
                    f"shaped like {tuple(v.shape)}; got "
                    f"{None if v_first is None else tuple(v_first.shape)}"
                )
            mixed = v + (v_first - v) * heads(torch.sigmoid(self.v0 + self.v_lora(x_v)))
        y, S = rwkv7_recurrence(
            r, heads(log_w), k, mixed, kappa, heads(iclr),
            None if state is None else state.S, c.chunk_len,
        )  # fmt: skip
        y = self.out_norm(y.transpose(1, 2).reshape(B * T, c.inner)).view(B, T, c.inner)
        bonus = (r * k * self.r_k).sum(dim=-1, keepdim=True) * mixed  # (B, H, T, D)
        y = y + bonus.transpose(1, 2).reshape(B, T, c.inner)
        seen = T if state is None else state.seen + T
        return self.output(y * self.gate(x_g)), RWKV7State(S=S, seen=seen), v
