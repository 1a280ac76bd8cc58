"""RWKV-7's generalised delta rule over chunks of C tokens (the recurrence of `naive.py`).

Within a chunk, with a = -kappa and b = iclr * kappa, the update reads
S_t = S_{t-1} D_t + u_t b_t^T + v_t k_t^T with u_t = S_{t-1} a_t and D_t = diag(w_t).
Unrolled from the chunk's initial state S_0, with L_t the cumulative log decay inside the chunk
(L_0 = 0) and E(i, s) = diag(exp(L_i - L_s)), the decay from just after token s to token i:

    S_t = S_0 E(t, 0) + sum_{s <= t} (u_s b_s^T + v_s k_s^T) E(t, s)
    u_t = S_0 E(t-1, 0) a_t + sum_{s < t} [b_s^T E(t-1, s) a_t] u_s + [k_s^T E(t-1, s) a_t] v_s
    y_t = S_0 E(t, 0) r_t   + sum_{s <= t} [b_s^T E(t, s) r_t] u_s + [k_s^T E(t, s) r_t] v_s

so the u's of a chunk solve one unit lower-triangular C x C system, and outputs and the
chunk-end state are matmuls; only S_0 passes from chunk to chunk. The decay factors are exps of
differences of cumulative log decays, never ratios of cumulative products (which underflow),
and E(i, s) factors through the chunk's middle m as exp(L_i - m) exp(m - L_s), so that the
bracketed C x C matrices are products of (C, Dk) matrices: O(C^2 Dk) multiply-adds per chunk in
GEMMs and O(C Dk) memory per chunk. The factors reach exp(span / 2), span being the total log
decay of a chunk's most-decaying channel; where a span passes MAX_SPAN the chunk length is
halved until none does (RWKV-7's decays, at least exp(-exp(-1/2)) per token, stay inside for
chunks up to 98 tokens), and a single token decaying past it is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

MAX_SPAN = 60.0  # largest total log decay of one chunk: factors up to exp(30), products exp(60)


def check_recurrence_inputs(
    r: Tensor,
    log_w: Tensor,
    k: Tensor,
    v: Tensor,
    kappa: Tensor,
    iclr: Tensor,
    state: Tensor | None,
) -> None:
    """Raise ValueError naming the argument whose shape does not fit r (B, H, T, Dk)."""
    if r.dim() != 4:
        raise ValueError(f"r: expected (batch, heads, tokens, Dk), got {tuple(r.shape)}")
    for name, t in (("log_w", log_w), ("k", k), ("kappa", kappa), ("iclr", iclr)):
        if t.shape != r.shape:
            raise ValueError(
                f"{name}: expected the shape of r {tuple(r.shape)}, got {tuple(t.shape)}"
            )
    if v.dim() != 4 or v.shape[:3] != r.shape[:3]:
        raise ValueError(f"v: expected {tuple(r.shape[:3])} + (Dv,), got {tuple(v.shape)}")
    want = (*r.shape[:2], v.shape[-1], r.shape[-1])
    if state is not None and state.shape != want:
        raise ValueError(
            f"state: expected S_0 (B, H, Dv, Dk) = {want}, got {tuple(state.shape)}; pass the "
            "state returned for the same batch and heads"
        )


def chunk_within_span(log_w: Tensor, chunk_len: int) -> int:
    """The chunk length the recurrence runs: chunk_len, halved (rounding up) until no chunk of
    log_w (B, H, T, Dk) decays by more than exp(-MAX_SPAN) in any channel; a token that alone
    decays more is refused."""
    B, H, T, Dk = log_w.shape
    C, lw = chunk_len, log_w.detach().to(torch.promote_types(log_w.dtype, torch.float32))
    while True:
        n = -(-T // C)
        totals = F.pad(lw, (0, 0, 0, n * C - T)).view(B, H, n, C, Dk).sum(dim=3)
        span = float(-totals.amin()) if totals.numel() else 0.0  # the most-decaying channel
        if span <= MAX_SPAN:
            return C
        if C == 1:
            raise ValueError(
                f"log_w: a token decays by exp(-{span:.1f}) in one channel, past "
                f"exp(-{MAX_SPAN:g}), where the factored decays lose range; clamp log_w at "
                f"-{MAX_SPAN:g} (a decay of exp(-{MAX_SPAN:g}) is 0 to float64 precision)"
            )
        C = -(-C // 2)


def rwkv7_recurrence(
    r: Tensor,
    log_w: Tensor,
    k: Tensor,
    v: Tensor,
    kappa: Tensor,
    iclr: Tensor,
    state: Tensor | None = None,
    chunk_len: int = 16,
) -> tuple[Tensor, Tensor]:
    """The RWKV-7 recurrence (see `rwkv7_recurrence_naive`) computed chunk by chunk.

    r: receptance (the query), log_w: log decay (<= 0), k: replacement key k~, kappa: removal
    key (unit norm per head), iclr: in-context learning rate, all (B, H, T, Dk); v: (B, H, T,
    Dv); state: S_0 (B, H, Dv, Dk) or None (zeros). -> (y (B, H, T, Dv) in r's dtype, S_T
    (B, H, Dv, Dk) in float32 at least). Runs in float32 at least, with autocast off (the
    triangular solve has no half-precision kernels). Any T (a partial last chunk is padded
    with tokens that leave the state as it is) and any chunk_len: a chunk that would decay past
    exp(-MAX_SPAN) in a channel runs as shorter chunks (`chunk_within_span`).
    """
    check_recurrence_inputs(r, log_w, k, v, kappa, iclr, state)
    if chunk_len < 1:
        raise ValueError(f"chunk_len: must be >= 1, got {chunk_len}")
    B, H, T, Dk = r.shape
    Dv, C = v.shape[-1], chunk_within_span(log_w, chunk_len)
    wide = torch.promote_types(r.dtype, torch.float32)
    n = -(-T // C)
    with torch.autocast(r.device.type, enabled=False):

        def chunks(x: Tensor) -> Tensor:  # (B, H, T, D) -> (B, H, n, C, D), zero padded
            x = F.pad(x.to(wide), (0, 0, 0, n * C - T))
            return x.view(B, H, n, C, x.shape[-1])

        # padding: decay 1 (log 0), no key, value, removal or query: the state stays put
        r_, lw, k_, v_, kap, ic = map(chunks, (r, log_w, k, v, kappa, iclr))
        a, b = -kap, kap * ic
        L = lw.cumsum(dim=3)  # L_1 .. L_C
        L0 = F.pad(L, (0, 0, 1, 0))  # L_0 .. L_C
        # E(i, s) = exp(L_i - m) exp(m - L_s), m = L at the chunk's middle: every factor is at
        # most exp(span / 2), and the products above the diagonal, which are dropped, at most
        # exp(span).
        m = L0[..., C // 2 : C // 2 + 1, :]
        a_f, r_f = a * (L0[..., :-1, :] - m).exp(), r_ * (L - m).exp()  # rows t: E(t - 1, .)
        b_f, k_f = b * (m - L).exp(), k_ * (m - L).exp()  # columns s
        M_ab = (a_f @ b_f.transpose(-1, -2)).tril(-1)  # [b_s^T E(t - 1, s) a_t], s < t
        M_ak = (a_f @ k_f.transpose(-1, -2)).tril(-1)
        M_rb = (r_f @ b_f.transpose(-1, -2)).tril()  # [b_s^T E(t, s) r_t], s <= t
        M_rk = (r_f @ k_f.transpose(-1, -2)).tril()
        eye = torch.eye(C, dtype=wide, device=r.device)
        # u = X_a S_0^T + U_v, with (I - M_ab) [X_a, U_v] = [a E(t-1, 0), M_ak v]
        X_a, U_v = torch.linalg.solve_triangular(
            eye - M_ab,
            torch.cat([a * L0[..., :-1, :].exp(), M_ak @ v_], dim=-1),
            upper=False,
            unitriangular=True,
        ).split([Dk, Dv], dim=-1)
        Q = r_ * L.exp() + M_rb @ X_a  # y = Q S_0^T + Y_v
        Y_v = M_rb @ U_v + M_rk @ v_
        to_end = (L[..., -1:, :] - L).exp()  # E(C, s): (B, H, n, C, Dk)
        b_end, k_end, decay = b * to_end, k_ * to_end, L[..., -1, :].exp()
        S = r_.new_zeros(B, H, Dv, Dk) if state is None else state.to(wide)
        ys = []
        for c in range(n):
            S_T = S.transpose(-1, -2)
            ys.append(Q[:, :, c] @ S_T + Y_v[:, :, c])
            u = X_a[:, :, c] @ S_T + U_v[:, :, c]
            S = (
                S * decay[:, :, c, None, :]
                + u.transpose(-1, -2) @ b_end[:, :, c]
                + v_[:, :, c].transpose(-1, -2) @ k_end[:, :, c]
            )
        y = (
            torch.stack(ys, dim=2).view(B, H, n * C, Dv)[:, :, :T]
            if n
            else v.new_zeros(B, H, 0, Dv)
        )
    return y.to(r.dtype), S
