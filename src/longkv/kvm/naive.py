"""Naive KVM reference: one token, one head, one slot at a time, straight from the spec.

Slow and obviously correct. It processes a whole sequence in one call (no state in) and returns
the final state, so the tests can compare `kvm_attention` over any segmentation against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from longkv.attention.state import WindowCache
from longkv.kvm.config import KVMConfig, desired_state_len
from longkv.kvm.state import KVMState


@dataclass(frozen=True)
class _Inputs:
    """One call's arguments, defaults filled in: q (B, H, T, Dk), k (B, Hkv, T, Dk), v (B, Hkv,
    T, Dv), merge gates g (B, Hkv, T, 1), the affine of LN_s (Dk,) or None, per-head
    temperatures tau_w and tau_s (H,), and the logit scale."""

    config: KVMConfig
    q: Tensor
    k: Tensor
    v: Tensor
    g: Tensor
    norm_weight: Tensor | None
    norm_bias: Tensor | None
    tau_w: Tensor
    tau_s: Tensor
    scale: float

    def ln(self, x: Tensor) -> Tensor:
        """LN_s over the head dim."""
        return F.layer_norm(x, (self.q.shape[-1],), self.norm_weight, self.norm_bias, eps=1e-5)

    def prep(self, x: Tensor) -> Tensor:
        """LN_s(Z(x)): the first rope_dim channels zeroed, then LN_s."""
        P = self.config.rope_dim
        z = torch.cat([torch.zeros_like(x[..., :P]), x[..., P:]], dim=-1)
        return self.ln(z)

    def founder_r(self, x: Tensor) -> Tensor:
        """r (B, Hkv) of a slot founded by values x (B, Hkv, Dv): ||x|| in vlens mode, else 1."""
        return x.norm(dim=-1) if self.config.use_vlens else torch.ones(x.shape[:2], dtype=x.dtype)


@dataclass
class _Slots:
    """One entry per slot: key sums (B, Hkv, Dk), value sums (B, Hkv, Dv), radii or counts
    (B, Hkv)."""

    k: list[Tensor] = field(default_factory=list)
    v: list[Tensor] = field(default_factory=list)
    r: list[Tensor] = field(default_factory=list)

    def append(self, k: Tensor, v: Tensor, r: Tensor) -> None:
        """A new slot at the end."""
        self.k.append(k)
        self.v.append(v)
        self.r.append(r)


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
    C, N = config.chunk_len, config.window_chunks
    g = torch.ones(B, Hkv, T, 1, dtype=q.dtype) if gate is None else gate
    tau_w = torch.ones(H, dtype=q.dtype) if window_temp is None else window_temp
    tau_s = torch.ones(H, dtype=q.dtype) if state_temp is None else state_temp
    scale = Dk**-0.5 if scale is None else scale
    inp = _Inputs(config, q, k, v, g, norm_weight, norm_bias, tau_w, tau_s, scale)

    slots = _Slots()
    cov = 0  # the slots summarise tokens [0, cov)
    outs = []
    for p in range(T):
        if p < C:
            slots.append(inp.prep(k[:, :, p]), v[:, :, p], inp.founder_r(v[:, :, p]))
            cov = p + 1
        c = p // C
        if c >= N and cov < (c - N + 1) * C:
            _update(inp, slots, cov)
            cov += C
        outs.append(_read_out(inp, slots, p))  # (B, H, Dv)

    start = max(0, -(-T // C) * C - config.window_len)
    state = KVMState.of(
        config=config,
        slot_k=torch.stack(slots.k, dim=2),
        slot_v=torch.stack(slots.v, dim=2),
        slot_r=torch.stack(slots.r, dim=2),
        window=WindowCache.of(k[:, :, start:], v[:, :, start:], T, g[:, :, start:]),
    )
    return torch.stack(outs, dim=2), state


def _read_out(inp: _Inputs, slots: _Slots, p: int) -> Tensor:
    """Output (B, H, Dv) of query p: one softmax over the slots (once p's chunk is past the
    first window_chunks) and the window tokens [lo, p]."""
    q, k, v, config = inp.q, inp.k, inp.v, inp.config
    H, Hkv = q.shape[1], k.shape[1]
    C, N = config.chunk_len, config.window_chunks
    c = p // C
    lo = max(0, (c - N + 1) * C)
    heads = []
    for h in range(H):
        j = h // (H // Hkv)
        logits, values = [], []
        if c >= N:
            for i in range(len(slots.k)):
                key, val = _slot_read(inp, slots, i, j)
                logits.append((q[:, h, p] * (key * inp.tau_s[h])).sum(-1) * inp.scale)
                values.append(val)
        for t in range(lo, p + 1):
            logits.append((q[:, h, p] * k[:, j, t] * inp.tau_w[h]).sum(-1) * inp.scale)
            values.append(v[:, j, t])
        w = torch.softmax(torch.stack(logits, dim=-1), dim=-1)  # (B, L)
        heads.append((w[..., None] * torch.stack(values, dim=1)).sum(1))  # (B, Dv)
    return torch.stack(heads, dim=1)


def _slot_read(inp: _Inputs, slots: _Slots, i: int, j: int) -> tuple[Tensor, Tensor]:
    """Slot i of kv head j as attention reads it: key LN_s(s_k) (B, Dk) and value (B, Dv), the
    direction of s_v times r in vlens mode, else s_v / count."""
    key = inp.ln(slots.k[i][:, j])
    if inp.config.use_vlens:
        val = slots.v[i][:, j] / slots.v[i][:, j].norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return key, val * slots.r[i][:, j, None]
    return key, slots.v[i][:, j] / slots.r[i][:, j, None]


def _update(inp: _Inputs, slots: _Slots, cov: int) -> None:
    """Fold the block [cov, cov + C) into the slots (spec section 5): as many tokens as the
    budget allows become new slots, the others merge into their nearest slot."""
    config, k, v, g = inp.config, inp.k, inp.v, inp.g
    B, Hkv = k.shape[:2]
    C, W = config.chunk_len, config.window_len
    ts = range(cov, cov + C)
    ku = {t: inp.prep(k[:, :, t]) for t in ts}
    kg = {t: ku[t] * g[:, :, t] for t in ts}
    vg = {t: v[:, :, t] * g[:, :, t] for t in ts}
    S0 = len(slots.k)
    n_app = min(max(desired_state_len(config, W + cov, cov + C, S0) - S0, 0), C)
    appended = _novel_tokens(ts, ku, [inp.ln(x) for x in slots.k], n_app)
    src_k, src_v = (kg, vg) if config.gate_appends else (ku, {t: v[:, :, t] for t in ts})
    for m in range(n_app):  # new slot m of row (b, h): its m-th appended token
        new_k, new_v = (
            torch.stack(
                [torch.stack([src[appended[b][h][m]][b, h] for h in range(Hkv)]) for b in range(B)]
            )
            for src in (src_k, src_v)
        )
        slots.append(new_k, new_v, inp.founder_r(new_v))
    _merge(inp, slots, ts, kg, vg, appended)


def _novel_tokens(
    ts: range, ku: dict[int, Tensor], read: list[Tensor], n_app: int
) -> list[list[list[int]]]:
    """appended[b][h]: the n_app tokens t of row (b, h) whose keys ku[t] (B, Hkv, Dk) are the
    least similar to their most similar slot key in `read` (B, Hkv, Dk), in time order."""
    B, Hkv = ku[ts[0]].shape[:2]
    novelty = {t: torch.stack([(ku[t] * r).sum(-1) for r in read]).amax(0).detach() for t in ts}
    return [
        [
            sorted(sorted(ts, key=lambda t, b=b, h=h: (novelty[t][b, h].item(), t))[:n_app])
            for h in range(Hkv)
        ]
        for b in range(B)
    ]


def _merge(
    inp: _Inputs, slots: _Slots, ts: range, kg: dict[int, Tensor], vg: dict[int, Tensor],
    appended: list[list[list[int]]],
) -> None:  # fmt: skip
    """Add each token t of ts that did not become a slot in row (b, h), its gated key kg[t]
    (B, Hkv, Dk) and value vg[t] (B, Hkv, Dv), into the slot past the sinks whose key is the
    most similar; a merge adds 1 to the slot's count unless r is the founder's norm."""
    B, Hkv = inp.k.shape[:2]
    read = [inp.ln(x) for x in slots.k]
    adds_k = [torch.zeros_like(x) for x in slots.k]
    adds_v = [torch.zeros_like(x) for x in slots.v]
    adds_n = [torch.zeros_like(x) for x in slots.r]
    for t in ts:
        merges = torch.tensor([[t not in appended[b][h] for h in range(Hkv)] for b in range(B)])
        sims = torch.stack([(kg[t] * r).sum(-1) for r in read], dim=-1)  # (B, Hkv, S)
        sims[..., : inp.config.sink_len] = float("-inf")
        dest = sims.argmax(-1)
        for i in range(len(slots.k)):
            hit = ((dest == i) & merges).to(inp.q.dtype)  # (B, Hkv)
            adds_k[i] = adds_k[i] + kg[t] * hit[..., None]
            adds_v[i] = adds_v[i] + vg[t] * hit[..., None]
            adds_n[i] = adds_n[i] + hit
    for i in range(len(slots.k)):
        slots.k[i] = slots.k[i] + adds_k[i]
        slots.v[i] = slots.v[i] + adds_v[i]
        if not inp.config.use_vlens:
            slots.r[i] = slots.r[i] + adds_n[i]
