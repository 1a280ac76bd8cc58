"""Shared pieces of every attention in longkv: input checks, head grouping, one masked softmax."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Dims:
    """Sizes read off q (B, H, T, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv)."""

    B: int
    H: int
    Hkv: int
    T: int
    Dk: int
    Dv: int

    @property
    def groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.H // self.Hkv


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> Dims:
    """Validate q (B, H, T, Dk), k (B, Hkv, T, Dk), v (B, Hkv, T, Dv) and return their sizes."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name}: expected 4 dims (batch, heads, tokens, head_dim), got shape "
                f"{tuple(t.shape)}; transpose a (B, T, H, D) tensor with .transpose(1, 2)"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating dtype, got {t.dtype}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name}: dtype/device {t.dtype}/{t.device} differs from q's {q.dtype}/{q.device}; "
                "cast all inputs with .to(q)"
            )
    B, H, T, Dk = q.shape
    Hkv = k.shape[1]
    if T == 0:
        raise ValueError("q: has no tokens (T = 0); pass at least one token per call")
    if k.shape[0] != B or k.shape[2] != T or k.shape[3] != Dk:
        raise ValueError(
            f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)}; expected "
            f"(B={B}, Hkv, T={T}, Dk={Dk})"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v: shape {tuple(v.shape)} does not match k {tuple(k.shape)} in (B, Hkv, T)"
        )
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(
            f"k: {Hkv} key/value heads do not divide {H} query heads; use a divisor of {H}"
        )
    return Dims(B=B, H=H, Hkv=Hkv, T=T, Dk=Dk, Dv=v.shape[3])


def check_optional(
    name: str, t: Tensor | None, shape: tuple[int, ...], like: Tensor
) -> Tensor | None:
    """Validate an optional tensor argument's shape, dtype and device against `like`."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.dtype != like.dtype or t.device != like.device:
        raise ValueError(
            f"{name}: dtype/device {t.dtype}/{t.device} differs from q's "
            f"{like.dtype}/{like.device}; cast it with .to(q)"
        )
    return t


def logit_scale(dims: Dims, scale: float | None) -> float:
    """The softmax scale: `scale`, or 1/sqrt(Dk) when None."""
    return dims.Dk**-0.5 if scale is None else scale


def group_heads(q: Tensor, Hkv: int) -> Tensor:
    """(B, H, T, D) -> (B, Hkv, G, T, D): the G query heads that share each key/value head."""
    B, H, T, D = q.shape
    return q.view(B, Hkv, H // Hkv, T, D)


def ungroup_heads(x: Tensor) -> Tensor:
    """(B, Hkv, G, T, D) -> (B, H, T, D)."""
    B, Hkv, G, T, D = x.shape
    return x.reshape(B, Hkv * G, T, D)


def hidden_outside_band(q_pos: Tensor, k_pos: Tensor, lo: Tensor) -> Tensor:
    """(Lq, Lk) bool, True where a key lies outside [lo(query), query]."""
    return (k_pos[None, :] > q_pos[:, None]) | (k_pos[None, :] < lo[:, None])


def hidden_future(n: int, device: torch.device) -> Tensor:
    """(n, n) bool, True above the diagonal: n queries against the same n keys."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def attention_logits(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """scale * q.k for grouped queries q (B, Hkv, G, Lq, Dk) and keys k (B, Hkv, Lk, Dk).

    Returns (B, Hkv, G, Lq, Lk); the G query heads of a group share their key head.
    """
    B, Hkv, G, Lq, Dk = q.shape
    return ((q * scale).view(B, Hkv, G * Lq, Dk) @ k.transpose(-1, -2)).view(B, Hkv, G, Lq, -1)


@dataclass(frozen=True)
class KeySet:
    """One set of keys for `attend_key_sets`: grouped queries q (B, Hkv, G, Lq, Dk), with the
    softmax scale (and any temperature) already multiplied in, against keys k (B, Hkv, Lk, Dk)
    and values v (B, Hkv, Lk, Dv); causal: the last Lq keys are the queries' own tokens, each
    query seeing those up to itself (every other key is visible to every query); bias
    (B, Hkv, Lk): added to every query's logit of each key, or (B, Hkv, G * Lq, Lk): to each
    query head's (heads major, as q's (G, Lq)) (None: 0)."""

    q: Tensor
    k: Tensor
    v: Tensor
    causal: bool = False
    bias: Tensor | None = None


def records_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd records operations on any of these tensors (None entries ignored)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# the fused CPU kernel behind scaled_dot_product_attention, which also returns the log-sum-exp
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attend_key_sets(sets: list[KeySet]) -> Tensor:
    """Softmax attention of the same queries over the union of several key sets, as if their
    logits were concatenated into one softmax. Returns (B, Hkv, G, Lq, Dv).

    Without autograd on the CPU, each set runs through torch's fused attention kernel, which
    never materialises the logits, and the sets are merged by their log-sum-exp; otherwise
    (gradients, other devices) the logits are computed, concatenated and softmaxed.
    """
    return attend_key_sets_lse(sets)[0]


def attend_key_sets_lse(sets: list[KeySet]) -> tuple[Tensor, Tensor]:
    """`attend_key_sets` and the log-sum-exp of each query head's logits over all the sets,
    (B, Hkv, G * Lq) (float32 for 16-bit inputs): a key's probability is exp(its logit - it)."""
    first = sets[0].q
    if not _fused(sets):
        return _attend_concatenated(sets)
    B, Hkv, G, Lq, Dk = first.shape
    Dv = sets[0].v.shape[-1]
    D = max(Dk, Dv)  # the kernel takes one head size: zero channels change no logit or value
    out, lse = None, None
    for s in sets:
        q = _widen(s.q.reshape(B, Hkv, G * Lq, Dk), D)  # the G heads of a group share the keys
        causal = s.causal and Lq > 1  # a single query sees every key of its set
        mask = _causal_tail(Lq, s.k.shape[2], G, q.dtype, q.device) if causal else None
        bias = None
        if s.bias is not None:  # (B, Hkv, 1, Lk): the kernel broadcasts it over the queries
            bias = s.bias.unsqueeze(2) if s.bias.dim() == 3 else s.bias
            mask = bias if mask is None else bias + mask
        o, m = _FLASH_CPU(q, _widen(s.k, D), _widen(s.v, D), attn_mask=mask, scale=1.0)[:2]
        if bias is not None:  # a query that sees no key of the set: the kernel's lse is 0
            m = m.masked_fill((bias == -math.inf).all(-1).expand(B, Hkv, G * Lq), -math.inf)
        if out is None or lse is None:
            out, lse = o, m
        else:  # softmax over both sets: each part weighted by its share of exp(lse)
            share = torch.sigmoid(m - lse).unsqueeze(-1)  # lse is float32 for 16-bit inputs
            out = torch.lerp(out, o, share if share.dtype == o.dtype else share.to(o.dtype))
            lse = torch.logaddexp(lse, m)
    assert out is not None and lse is not None
    return (out if D == Dv else out[..., :Dv]).reshape(B, Hkv, G, Lq, Dv), lse


def _widen(t: Tensor, D: int) -> Tensor:
    """t (..., d) with zero channels appended up to D."""
    return t if t.shape[-1] == D else torch.nn.functional.pad(t, (0, D - t.shape[-1]))


def _fused(sets: list[KeySet]) -> bool:
    """Whether the fused CPU kernel runs the sets: on the CPU, without gradients."""
    if _FLASH_CPU is None or sets[0].q.device.type != "cpu":
        return False
    return not records_grad(*(t for s in sets for t in (s.q, s.k, s.v, s.bias)))


@functools.lru_cache(maxsize=16)
def _causal_tail(Lq: int, Lk: int, G: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(G * Lq, Lk): the additive mask of Lq queries that see all Lk keys but the future ones
    among their own last Lq; kept per shape, made outside inference mode so that it stays
    usable everywhere."""
    with torch.inference_mode(False):
        mask = torch.zeros(G, Lq, Lk, dtype=dtype, device=device)
        mask[..., Lk - Lq :].masked_fill_(hidden_future(Lq, device), float("-inf"))
        return mask.view(G * Lq, Lk)


def _attend_concatenated(sets: list[KeySet]) -> tuple[Tensor, Tensor]:
    B, Hkv, G, Lq, _ = sets[0].q.shape
    logits = []
    for s in sets:
        part = (s.q.reshape(B, Hkv, G * Lq, -1) @ s.k.transpose(-1, -2)).view(B, Hkv, G, Lq, -1)
        if s.bias is not None:
            bias = s.bias.unsqueeze(2) if s.bias.dim() == 3 else s.bias
            part = part + bias.view(B, Hkv, -1, 1 if bias.shape[2] == 1 else Lq, part.shape[-1])
        if s.causal:
            part[..., part.shape[-1] - Lq :].masked_fill_(hidden_future(Lq, part.device), -math.inf)
        logits.append(part)
    every = torch.cat(logits, dim=-1) if len(logits) > 1 else logits[0]
    probs = torch.softmax(every, dim=-1).view(B, Hkv, G * Lq, -1)
    out, at = None, 0
    for s in sets:
        n = s.k.shape[2]
        o = probs[..., at : at + n] @ s.v
        out = o if out is None else out + o
        at += n
    assert out is not None
    return out.view(B, Hkv, G, Lq, -1), every.logsumexp(-1).reshape(B, Hkv, G * Lq)


def attend(logits: Tensor, v: Tensor, hide: Tensor | None = None) -> Tensor:
    """Softmax of logits (B, Hkv, G, Lq, Lk) over keys, then the average of v (B, Hkv, Lk, Dv).

    hide: (Lq, Lm) bool, True = not visible, for the last Lm keys (earlier keys are visible to
    every query); every query must see at least one key. Returns (B, Hkv, G, Lq, Dv).
    """
    B, Hkv, G, Lq, Lk = logits.shape
    if hide is not None:
        logits[..., Lk - hide.shape[1] :].masked_fill_(hide, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return (probs.view(B, Hkv, G * Lq, Lk) @ v).view(B, Hkv, G, Lq, -1)
