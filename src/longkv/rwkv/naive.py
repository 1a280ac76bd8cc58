"""Naive RWKV-7 reference: the generalised delta rule one token at a time, straight from the
recurrence. Slow and obviously correct; `rwkv7_recurrence` must match it.

Per batch row and head, the state S is (Dv, Dk): row i is value channel i, column j key
channel j. With w_t = exp(log_w_t):

    S_t = S_{t-1} (diag(w_t) - kappa_t^T (iclr_t * kappa_t)) + v_t^T k_t,    y_t = S_t r_t

(kappa_t, iclr_t, k_t, r_t as row vectors of Dk; the middle term removes from S the value
it holds at the removal key kappa_t, at in-context learning rate iclr_t per key channel).
"""

from __future__ import annotations

import torch
from torch import Tensor


def rwkv7_recurrence_naive(
    r: Tensor,
    log_w: Tensor,
    k: Tensor,
    v: Tensor,
    kappa: Tensor,
    iclr: Tensor,
    state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference for `rwkv7_recurrence`, same arguments.

    r, log_w, k, kappa, iclr: (B, H, T, Dk); v: (B, H, T, Dv); state: S_0 (B, H, Dv, Dk) or
    None (zeros) -> (y (B, H, T, Dv), S_T (B, H, Dv, Dk)).
    """
    B, H, T, Dk = r.shape
    S = r.new_zeros(B, H, v.shape[-1], Dk) if state is None else state
    ys = []
    for t in range(T):
        w, kap = log_w[:, :, t].exp(), kappa[:, :, t]
        removed = (S @ kap[..., None]) @ (iclr[:, :, t] * kap)[..., None, :]  # S kap^T (a kap)
        S = S * w[..., None, :] - removed + v[:, :, t, :, None] @ k[:, :, t, None, :]
        ys.append((S @ r[:, :, t, :, None])[..., 0])
    y = torch.stack(ys, dim=2) if ys else v.new_zeros(B, H, 0, v.shape[-1])
    return y, S
