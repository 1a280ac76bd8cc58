"""Naive KVM reference: one token, one head, one slot at a time, straight from the spec.

Slow and obviously correct. It processes a whole sequence in one call (no state in) and returns
the final state, so the tests can compare `kvm_attention` over any segmentation against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from longkv.attention.state import WindowCache
from longkv.kvm.config import KVMConfig, desired_state_len
from longkv.kvm.state import KVMState


def kvm_attention_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: KVMConfig,
    *,
    gate: Tensor | None = None,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    window_temp: Tensor | None = None,
    state_temp: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, KVMState]:
    """Reference for `kvm_attention` with state=None; same arguments and shapes."""
    B, H, T, Dk = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    C, N, s, P = config.chunk_len, config.window_chunks, config.sink_len, config.rope_dim
    W = N * C
    g = torch.ones(B, Hkv, T, 1, dtype=q.dtype) if gate is None else gate
    tau_w = torch.ones(H, dtype=q.dtype) if window_temp is None else window_temp
    tau_s = torch.ones(H, dtype=q.dtype) if state_temp is None else state_temp
    scale = Dk**-0.5 if scale is None else scale

    def ln(x: Tensor) -> Tensor:  # LN_s over the head dim
        return F.layer_norm(x, (Dk,), norm_weight, norm_bias, eps=1e-5)

    def prep(x: Tensor) -> Tensor:  # LN_s(Z(x))
        z = torch.cat([torch.zeros_like(x[..., :P]), x[..., P:]], dim=-1)
        return ln(z)

    def founder_r(x: Tensor) -> Tensor:  # (B, Hkv)
        return x.norm(dim=-1) if config.use_vlens else torch.ones(B, Hkv, dtype=x.dtype)

    # One entry per slot, each (B, Hkv, ...): key sum, value sum, radius or count.
    sk: list[Tensor] = []
    sv: list[Tensor] = []
    sr: list[Tensor] = []
    cov = 0  # the slots summarise tokens [0, cov)

    def update() -> None:
        """Fold the block [cov, cov + C) into the slots (spec section 5)."""
        ts = range(cov, cov + C)
        ku = {t: prep(k[:, :, t]) for t in ts}
        kg = {t: ku[t] * g[:, :, t] for t in ts}
        vg = {t: v[:, :, t] * g[:, :, t] for t in ts}
        S0 = len(sk)
        n_app = min(max(desired_state_len(config, W + cov, cov + C, S0) - S0, 0), C)
        read = [ln(x) for x in sk]
        # appended[b][h]: the tokens of row (b, h) that become new slots, in time order
        novelty = {t: torch.stack([(ku[t] * r).sum(-1) for r in read]).amax(0).detach() for t in ts}
        appended = [
            [
                sorted(sorted(ts, key=lambda t, b=b, h=h: (novelty[t][b, h].item(), t))[:n_app])
                for h in range(Hkv)
            ]
            for b in range(B)
        ]
        src_k, src_v = (kg, vg) if config.gate_appends else (ku, {t: v[:, :, t] for t in ts})
        for m in range(n_app):
            new_k = torch.stack(
                [
                    torch.stack([src_k[appended[b][h][m]][b, h] for h in range(Hkv)])
                    for b in range(B)
                ]
            )
            new_v = torch.stack(
                [
                    torch.stack([src_v[appended[b][h][m]][b, h] for h in range(Hkv)])
                    for b in range(B)
                ]
            )
            sk.append(new_k)
            sv.append(new_v)
            sr.append(founder_r(new_v))
        read = [ln(x) for x in sk]
        adds_k = [torch.zeros_like(x) for x in sk]
        adds_v = [torch.zeros_like(x) for x in sv]
        adds_n = [torch.zeros_like(x) for x in sr]
        for t in ts:
            merges = torch.tensor([[t not in appended[b][h] for h in range(Hkv)] for b in range(B)])
            sims = torch.stack([(kg[t] * r).sum(-1) for r in read], dim=-1)  # (B, Hkv, S)
            sims[..., :s] = float("-inf")
            dest = sims.argmax(-1)
            for i in range(len(sk)):
                hit = ((dest == i) & merges).to(q.dtype)  # (B, Hkv)
                adds_k[i] = adds_k[i] + kg[t] * hit[..., None]
                adds_v[i] = adds_v[i] + vg[t] * hit[..., None]
                adds_n[i] = adds_n[i] + hit
        for i in range(len(sk)):
            sk[i] = sk[i] + adds_k[i]
            sv[i] = sv[i] + adds_v[i]
            if not config.use_vlens:
                sr[i] = sr[i] + adds_n[i]

    outs = []
    for p in range(T):
        if p < C:
            sk.append(prep(k[:, :, p]))
            sv.append(v[:, :, p])
            sr.append(founder_r(v[:, :, p]))
            cov = p + 1
        c = p // C
        if c >= N and cov < (c - N + 1) * C:
            update()
            cov += C
        lo = max(0, (c - N + 1) * C)
        heads = []
        for h in range(H):
            j = h // G
            logits, values = [], []
            if c >= N:
                for i in range(len(sk)):
                    key = ln(sk[i][:, j]) * tau_s[h]
                    if config.use_vlens:
                        val = sv[i][:, j] / sv[i][:, j].norm(dim=-1, keepdim=True).clamp_min(1e-12)
                        val = val * sr[i][:, j, None]
                    else:
                        val = sv[i][:, j] / sr[i][:, j, None]
                    logits.append((q[:, h, p] * key).sum(-1) * scale)
                    values.append(val)
            for t in range(lo, p + 1):
                logits.append((q[:, h, p] * k[:, j, t] * tau_w[h]).sum(-1) * scale)
                values.append(v[:, j, t])
            w = torch.softmax(torch.stack(logits, dim=-1), dim=-1)  # (B, L)
            heads.append((w[..., None] * torch.stack(values, dim=1)).sum(1))  # (B, Dv)
        outs.append(torch.stack(heads, dim=1))  # (B, H, Dv)

    start = max(0, -(-T // C) * C - W)
    state = KVMState.of(
        config=config,
        slot_k=torch.stack(sk, dim=2),
        slot_v=torch.stack(sv, dim=2),
        slot_r=torch.stack(sr, dim=2),
        window=WindowCache.of(k[:, :, start:], v[:, :, start:], T, g[:, :, start:]),
    )
    return torch.stack(outs, dim=2), state
