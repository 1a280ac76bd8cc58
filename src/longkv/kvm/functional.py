"""Key-Value Means attention, chunk-parallel (spec: docs/kvm.md).

Queries of one chunk are computed together against [state slots ; block window]; the state is
updated once per chunk that leaves the window, so the only Python loop runs over chunks.
`naive.py` holds the token-by-token reference that the tests compare this against.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from longkv.attention.core import (
    Dims,
    attend,
    attention_logits,
    check_optional,
    check_qkv,
    group_heads,
    hidden_future,
    logit_scale,
    ungroup_heads,
)
from longkv.attention.state import WindowCache
from longkv.kvm.config import KVMConfig, desired_state_len
from longkv.kvm.state import KVMState, window_start

LN_EPS = 1e-5


def state_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """LN_s: LayerNorm over the last (head) dim, eps 1e-5, shared by all heads."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps=LN_EPS)


def prep_keys(k: Tensor, config: KVMConfig, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """prep(k) = LN_s(Z(k)): rotary channels zeroed, then LN_s. k: (..., Dk)."""
    if config.rope_dim:
        k = k * _non_rotary(k.shape[-1], config.rope_dim, k.dtype, k.device)
    return state_norm(k, weight, bias)


@functools.cache
def _non_rotary(dim: int, rope_dim: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(dim,) with 0 on the first rope_dim channels and 1 elsewhere (read-only, shared)."""
    keep = torch.ones(dim, dtype=dtype, device=device)
    keep[:rope_dim] = 0
    return keep


def founder_r(v: Tensor, config: KVMConfig) -> Tensor:
    """Initial r of slots founded by values v (..., Dv): ||v|| in vlens mode, else count 1."""
    return torch.linalg.vector_norm(v, dim=-1) if config.use_vlens else v.new_ones(v.shape[:-1])


def read_state(
    state: KVMState, weight: Tensor | None, bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Just-in-time read-out: keys LN_s(s_k) (B, Hkv, S, Dk) and values (B, Hkv, S, Dv)."""
    keys = state_norm(state.slot_k, weight, bias)
    if state.config.use_vlens:  # normalize(s_v) * r
        norm = torch.linalg.vector_norm(state.slot_v, dim=-1).clamp_min(1e-12)
        return keys, state.slot_v * (state.slot_r / norm).unsqueeze(-1)
    return keys, state.slot_v / state.slot_r.unsqueeze(-1)


def _append(state: KVMState, k: Tensor, v: Tensor, r: Tensor) -> KVMState:
    """The state with new slots k (B, Hkv, n, Dk), v (B, Hkv, n, Dv), r (B, Hkv, n) at the end."""
    return replace(
        state,
        slot_k=torch.cat([state.slot_k, k], dim=2),
        slot_v=torch.cat([state.slot_v, v], dim=2),
        slot_r=torch.cat([state.slot_r, r], dim=2),
    )


def update_state(
    state: KVMState,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    cov: int,
    weight: Tensor | None,
    bias: Tensor | None,
    read_k: Tensor | None = None,
) -> KVMState:
    """Fold the C tokens [cov, cov + C) that leave the window into the slots (spec section 5).

    k: (B, Hkv, C, Dk) post-RoPE keys, v: (B, Hkv, C, Dv), g: (B, Hkv, C, 1) merge gates;
    read_k: LN_s(slot_k) (B, Hkv, S, Dk) if already computed. The returned state has the same
    window; only the slots change.
    """
    config = state.config
    C, Dk, Dv = config.chunk_len, k.shape[-1], v.shape[-1]
    S0 = state.num_slots
    ku = prep_keys(k, config, weight, bias)
    kg, vg = ku * g, v * g
    ka, va = (kg, vg) if config.gate_appends else (ku, v)
    target = desired_state_len(config, config.window_len + cov, cov + C, S0)
    n_append = min(max(target - S0, 0), C)
    if n_append == C:
        return _append(state, ka, va, founder_r(va, config))
    if read_k is None:
        read_k = state_norm(state.slot_k, weight, bias)  # (B, Hkv, S0, Dk)
    merged = None  # (B, Hkv, C, 1): 1 for tokens that merge, 0 for appended ones; None = all 1
    if n_append > 0:
        with torch.no_grad():
            novelty = (ku @ read_k.transpose(-1, -2)).amax(dim=-1)  # (B, Hkv, C)
            least = torch.argsort(novelty, dim=-1, stable=True)[..., :n_append]
            picked = least.sort(dim=-1).values  # (B, Hkv, n_append), in time order
        new_k = ka.gather(2, picked.unsqueeze(-1).expand(-1, -1, -1, Dk))
        new_v = va.gather(2, picked.unsqueeze(-1).expand(-1, -1, -1, Dv))
        state = _append(state, new_k, new_v, founder_r(new_v, config))
        read_k = torch.cat([read_k, state_norm(new_k, weight, bias)], dim=2)
        merged = torch.ones_like(g).scatter(2, picked.unsqueeze(-1), 0.0)
        kg, vg = kg * merged, vg * merged

    with torch.no_grad():  # merge targets: the most similar non-sink slot, first on ties
        sinks = config.sink_len
        logits = kg @ read_k[:, :, sinks:].transpose(-1, -2)  # (B, Hkv, C, S - sinks)
        dest = logits.max(dim=-1).indices + sinks  # (B, Hkv, C)
    idx = dest.unsqueeze(-1)
    slot_r = state.slot_r
    if not config.use_vlens:
        counts = g.new_ones(dest.shape) if merged is None else merged.squeeze(-1)
        slot_r = slot_r.scatter_add(2, dest, counts)
    return replace(
        state,
        slot_k=state.slot_k.scatter_add(2, idx.expand(-1, -1, -1, Dk), kg),
        slot_v=state.slot_v.scatter_add(2, idx.expand(-1, -1, -1, Dv), vg),
        slot_r=slot_r,
    )


def empty_state(config: KVMConfig, k: Tensor, v: Tensor) -> KVMState:
    """A state with no tokens, shaped for keys k (B, Hkv, T, Dk) and values v (B, Hkv, T, Dv)."""
    B, Hkv = k.shape[:2]
    return KVMState(
        config=config,
        slot_k=k.new_zeros(B, Hkv, 0, k.shape[-1]),
        slot_v=v.new_zeros(B, Hkv, 0, v.shape[-1]),
        slot_r=v.new_zeros(B, Hkv, 0),
        window=WindowCache.empty(k, v, with_gate=True),
    )


def check_state(state: object, config: KVMConfig, dims: Dims, like: Tensor) -> KVMState:
    """Raise a ValueError unless `state` can continue this call's sequence."""
    if not isinstance(state, KVMState):
        raise ValueError(
            f"state: expected a KVMState returned by kvm_attention, got {type(state).__name__}"
        )
    if state.config != config:
        raise ValueError(
            f"state: was made with {state.config} but this call uses {config}; continue a "
            "sequence with the config that started it"
        )
    state.window.check_fits(dims, like)
    return state


def kvm_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: KVMConfig,
    *,
    gate: Tensor | None = None,
    state: KVMState | None = None,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    window_temp: Tensor | None = None,
    state_temp: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, KVMState]:
    """Key-Value Means attention over T new tokens, continuing `state` (None starts a sequence).

    q: (B, H, T, Dk) and k: (B, Hkv, T, Dk) after RoPE; v: (B, Hkv, T, Dv); gate: (B, Hkv, T, 1)
    positive merge gates (None = ones); norm_weight, norm_bias: (Dk,) affine of LN_s;
    window_temp, state_temp: (H,) per-head temperatures; scale: logit scale (1/sqrt(Dk)).
    Returns out (B, H, T, Dv) and the state after the T tokens. Any segmentation of a sequence
    into calls gives the outputs and final state of one call over all of it.
    """
    dims = check_qkv(q, k, v)
    config.check_head_dim(dims.Dk)
    check_optional("gate", gate, (dims.B, dims.Hkv, dims.T, 1), q)
    check_optional("norm_weight", norm_weight, (dims.Dk,), q)
    check_optional("norm_bias", norm_bias, (dims.Dk,), q)
    check_optional("window_temp", window_temp, (dims.H,), q)
    check_optional("state_temp", state_temp, (dims.H,), q)
    if gate is None:
        gate = torch.ones_like(k[..., :1])
    elif bool((gate <= 0).any()):
        raise ValueError("gate: merge gates must be > 0 (e.g. 1 + elu(x)); got a value <= 0")
    state = empty_state(config, k, v) if state is None else check_state(state, config, dims, q)

    C, N = config.chunk_len, config.window_chunks
    n0 = state.seen
    win = state.window.extend(k, v, gate)  # tokens [base, n1)
    n1, base = win.seen, win.start
    if n0 < C:  # the first chunk is copied into the state as it arrives
        first = slice(n0 - base, min(n1, C) - base)
        k0, v0 = prep_keys(win.k[:, :, first], config, norm_weight, norm_bias), win.v[:, :, first]
        state = _append(state, k0, v0, founder_r(v0, config))
    cov = max(min(n1, C), window_start(config, n0))

    qg, scale = group_heads(q, dims.Hkv), logit_scale(dims, scale)  # (B, Hkv, G, T, Dk)
    group = (1, dims.Hkv, dims.groups, 1, 1)
    tau_w = None if window_temp is None else window_temp.view(group)
    tau_s = None if state_temp is None else state_temp.view(group)
    out = q.new_empty(dims.B, dims.Hkv, dims.groups, dims.T, dims.Dv)
    state_k = None  # LN_s(slot_k) of the slots as they stand, once computed
    future = hidden_future(min(C, dims.T), q.device)
    for c in range(n0 // C, (n1 - 1) // C + 1):
        a, b = max(n0, c * C), min(n1, (c + 1) * C)  # this call's queries in chunk c
        lo = max(0, (c - N + 1) * C)  # first window token of chunk c
        window = slice(lo - base, b - base)
        keys, values = win.k[:, :, window], win.v[:, :, window]
        S = 0
        if c >= N:
            if cov < lo:  # the chunk [cov, cov + C) left the window at this chunk's start
                blk = slice(cov - base, cov - base + C)
                k_b, v_b, g_b = win.k[:, :, blk], win.v[:, :, blk], win.g[:, :, blk]
                state = update_state(state, k_b, v_b, g_b, cov, norm_weight, norm_bias, state_k)
                cov = lo
            state_k, state_v = read_state(state, norm_weight, norm_bias)
            S = state.num_slots
            keys, values = torch.cat([state_k, keys], dim=2), torch.cat([state_v, values], dim=2)
        logits = attention_logits(qg[:, :, :, a - n0 : b - n0], keys, scale)  # (.., Lq, S + Lw)
        if tau_w is not None or (tau_s is not None and S):
            logits = logits * _key_temperature(tau_s, tau_w, S, b - lo, q)
        out[:, :, :, a - n0 : b - n0] = attend(logits, values, future[: b - a, : b - a])
    state = replace(state, window=win.keep_from(window_start(config, n1)))
    return ungroup_heads(out), state


def _key_temperature(
    tau_s: Tensor | None, tau_w: Tensor | None, S: int, Lw: int, like: Tensor
) -> Tensor:
    """Per-key logit multiplier (1, Hkv, G, 1, S + Lw): tau_s on state keys, tau_w on window."""
    ones = like.new_ones(1, 1, 1, 1, 1)
    s = (ones if tau_s is None else tau_s).expand(-1, -1, -1, -1, S)
    w = (ones if tau_w is None else tau_w).expand(-1, -1, -1, -1, Lw)
    return torch.cat([s, w], dim=-1)
