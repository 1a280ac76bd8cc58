"""Key-Value Means attention, chunk-parallel (spec: docs/kvm.md).

Queries of one chunk are computed together against [state slots ; block window]; the state is
updated once per chunk that leaves the window, so the only Python loop runs over chunks. The
update's routing and the read-out are `slots.py`'s, which KVM-Fold runs too; `naive.py` holds
the token-by-token reference that the tests compare this against.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from longkv.attention.core import (
    Dims,
    KeySet,
    attend_key_sets,
    check_optional,
    check_qkv,
    group_heads,
    logit_scale,
    records_grad,
    ungroup_heads,
)
from longkv.attention.state import Rows, WindowCache
from longkv.kvm.config import KVMConfig, desired_state_len
from longkv.kvm.slots import read_founder, read_mean, route, take
from longkv.kvm.state import KVMState, ReadOut, pack_slots, window_start

LN_EPS = 1e-5


# the smallest gate logit: exp(-80) ~ 1.8e-35 lies above the smallest normal number of float32
# and bfloat16 (1.2e-38), so a gate is never 0; below it the logit gets no gradient
GATE_FLOOR = -80.0


def merge_gate(logit: Tensor) -> Tensor:
    """g = 1 + elu(logit), > 0 in float32 and bfloat16 whatever the logit: computed as
    exp(logit) below 0 and logit + 1 above (1 + elu rounds to exactly 0 below about -17 in
    float32, -7 in bfloat16), the logit floored at GATE_FLOOR. Same shape as logit."""
    x = logit.clamp_min(GATE_FLOOR)
    # exp of the clamped branch only: exp(x) of a large positive x would be inf, and inf times
    # the zero gradient where() gives the unused branch is NaN
    return torch.where(x < 0, x.clamp_max(0).exp(), x + 1)


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
    """(dim,) with 0 on the first rope_dim channels and 1 elsewhere (read-only, shared).

    Made outside inference mode even when first asked for inside it (a fold, decoding), so the
    shared tensor stays usable in autograd afterwards.
    """
    with torch.inference_mode(False):
        keep = torch.ones(dim, dtype=dtype, device=device)
        keep[:rope_dim] = 0
    return keep


def founder_r(v: Tensor, config: KVMConfig) -> Tensor:
    """Initial r of slots founded by values v (..., Dv): ||v|| in vlens mode, else count 1."""
    return torch.linalg.vector_norm(v, dim=-1) if config.use_vlens else v.new_ones(v.shape[:-1])


def read_state(
    state: KVMState, weight: Tensor | None, bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Just-in-time read-out: keys LN_s(s_k) (B, Hkv, S, Dk) and values (B, Hkv, S, Dv); the
    state's kept read-out when its slots and the LN_s parameters are unchanged."""
    if state.read is not None and state.read.matches(weight, bias):
        return state.read.keys, state.read.values
    read_values = read_founder if state.config.use_vlens else read_mean  # r: norm or count
    return state_norm(state.slot_k, weight, bias), read_values(state.slot_v, state.slot_r)


def _append(
    state: KVMState, k: Tensor, v: Tensor, r: Tensor, first: int, donate: bool,
    picked: Tensor | None = None,
) -> KVMState:  # fmt: skip
    """The state with new slots k (B, Hkv, n, Dk), v (B, Hkv, n, Dv), r (B, Hkv, n) at the end,
    founded by the tokens at positions first + picked (B, Hkv, n), or first, first + 1, ...
    without picked; the positions are kept only where the state tracks founders."""
    founders = state.founders
    if founders is not None:
        at = torch.arange(r.shape[-1], device=r.device) if picked is None else picked
        founders = founders.append((first + at).expand(r.shape).unsqueeze(-1), donate)
    slots = state.slots.append(pack_slots(k, v, r), donate)
    return replace(state, slots=slots, founders=founders, read=None)


def found_first(
    state: KVMState, k: Tensor, v: Tensor, weight: Tensor | None, bias: Tensor | None,
    donate: bool = False,
) -> KVMState:  # fmt: skip
    """The state with tokens k (B, Hkv, n, Dk), v of the first chunk copied in as slots: the
    first chunk enters the state as it arrives (spec section 5)."""
    config, first = state.config, state.num_slots  # the first chunk's slot s is token s
    ku, r = prep_keys(k, config, weight, bias), founder_r(v, config)
    return _append(state, ku, v, r, first, donate)


def update_state(
    state: KVMState,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    cov: int,
    weight: Tensor | None,
    bias: Tensor | None,
    read_k: Tensor | None = None,
    donate: bool = False,
) -> KVMState:
    """Fold the C tokens [cov, cov + C) that leave the window into the slots (spec section 5).

    k: (B, Hkv, C, Dk) post-RoPE keys, v: (B, Hkv, C, Dv), g: (B, Hkv, C, 1) merge gates (> 0);
    read_k: LN_s(slot_k) (B, Hkv, S, Dk) if already computed; donate: the merges may add into
    the given state's slots in place (`kvm_attention`). The returned state has the same window;
    only the slots change.
    """
    config = state.config
    C, S0 = config.chunk_len, state.num_slots
    ku = prep_keys(k, config, weight, bias)
    kg, vg = ku * g, v * g
    ka, va = (kg, vg) if config.gate_appends else (ku, v)
    target = desired_state_len(config.budget_rule, config.window_len + cov, cov + C, S0)
    n_append = min(max(target - S0, 0), C)
    if n_append == C:
        return _append(state, ka, va, founder_r(va, config), cov, donate)
    if read_k is None:
        read_k = state_norm(state.slot_k, weight, bias)  # (B, Hkv, S0, Dk)
    # the gate, a positive factor per token, ranks nothing: the ungated ku serve every choice
    to = route(
        ku, read_k, config.sink_len, n_append, lambda p: state_norm(take(ka, p), weight, bias)
    )
    merged = None  # (B, Hkv, C, 1): 1 for tokens that merge, 0 for appended ones; None = all 1
    if n_append > 0:
        new_v = take(va, to.picked)
        new_r = founder_r(new_v, config)
        state = _append(state, take(ka, to.picked), new_v, new_r, cov, donate, to.picked)
        merged = to.merges.unsqueeze(-1).to(g.dtype)
        kg, vg = kg * merged, vg * merged

    if config.use_vlens:
        counts = g.new_zeros(to.dest.shape)  # r is the founder's norm: merges leave it
    else:
        counts = g.new_ones(to.dest.shape) if merged is None else merged.squeeze(-1)
    adds = torch.cat([kg, vg, counts.unsqueeze(-1)], dim=-1)  # (B, Hkv, C, Dk + Dv + 1)
    return replace(state, slots=state.slots.add_at(to.dest, adds, donate), read=None)


def empty_state(config: KVMConfig, k: Tensor, v: Tensor, track_founders: bool = False) -> KVMState:
    """A state with no tokens, shaped for keys k (B, Hkv, T, Dk) and values v (B, Hkv, T, Dv);
    track_founders: keep each slot's founding position (`KVMState.founders`)."""
    B, Hkv = k.shape[:2]
    slots = k.new_zeros(B, Hkv, 0, k.shape[-1] + v.shape[-1] + 1)
    founders = None
    if track_founders:
        founders = Rows.of(torch.zeros(B, Hkv, 0, 1, dtype=torch.long, device=k.device))
    return KVMState(
        config, Rows.of(slots), WindowCache.empty(k, v, with_gate=True), founders=founders
    )


def check_arguments(
    q: Tensor, k: Tensor, v: Tensor, config: KVMConfig, gate: Tensor | None,
    norm_weight: Tensor | None, norm_bias: Tensor | None, window_temp: Tensor | None,
    state_temp: Tensor | None,
) -> tuple[Dims, Tensor]:  # fmt: skip
    """The sizes of `kvm_attention`'s arguments and its gates (ones for None); a ValueError
    naming the argument for a wrong shape, dtype or device, or a gate <= 0."""
    dims = check_qkv(q, k, v)
    config.check_head_dim(dims.Dk)
    check_optional("gate", gate, (dims.B, dims.Hkv, dims.T, 1), q)
    check_optional("norm_weight", norm_weight, (dims.Dk,), q)
    check_optional("norm_bias", norm_bias, (dims.Dk,), q)
    check_optional("window_temp", window_temp, (dims.H,), q)
    check_optional("state_temp", state_temp, (dims.H,), q)
    if gate is None:
        return dims, torch.ones_like(k[..., :1])
    if bool((gate <= 0).any()):
        raise ValueError("gate: merge gates must be > 0 (e.g. merge_gate(x)); got a value <= 0")
    return dims, gate


def query_scales(
    dims: Dims, scale: float | None, state_temp: Tensor | None, window_temp: Tensor | None
) -> tuple[float | Tensor, float | Tensor]:
    """What grouped queries (B, Hkv, G, T, Dk) are multiplied by against the slots and against
    the window: the softmax scale times each head's temperature, (1, Hkv, G, 1, 1) or a float;
    the same object for both when no temperature tells them apart."""
    s = logit_scale(dims, scale)
    group = (1, dims.Hkv, dims.groups, 1, 1)
    tau_w = s if window_temp is None else s * window_temp.view(group)
    if state_temp is None and window_temp is None:
        return tau_w, tau_w
    return (s if state_temp is None else s * state_temp.view(group)), tau_w


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


def _arrive(
    state: KVMState, k: Tensor, v: Tensor, gate: Tensor, weight: Tensor | None,
    bias: Tensor | None, donate: bool,
) -> tuple[KVMState, WindowCache, int]:  # fmt: skip
    """New tokens k (B, Hkv, T, Dk), v (B, Hkv, T, Dv) and gate (B, Hkv, T, 1) arrive.

    Returns the state (those of the first chunk copied into its slots as they arrive), its window
    extended by all T tokens (in place when donated), and cov: the slots hold tokens [0, cov).
    """
    config, n0 = state.config, state.seen
    C = config.chunk_len
    win = state.window.extend(k, v, gate, own=donate)
    n1, base = win.seen, win.start
    if n0 < C:  # the first chunk is copied into the state as it arrives
        first = slice(n0 - base, min(n1, C) - base)
        k0, v0 = win.k[:, :, first], win.v[:, :, first]
        state = found_first(state, k0, v0, weight, bias, donate)
    return state, win, max(min(n1, C), window_start(config, n0))


def _chunked(
    qg: Tensor, sizes: list[int], win: WindowCache, C: int, tracked: bool
) -> tuple[tuple[Tensor, ...], Callable[[int, int, int], Tensor]]:
    """This call's grouped queries qg (B, Hkv, G, T, Dk) cut into its chunks (`sizes[j]` queries
    in the j-th), and `window_of`, which cuts the window win into whole chunks.

    Under autograd (`tracked`) every tensor is cut into its chunks once: the backward of a slice
    fills a zero tensor of the whole input, once per chunk, where that of a split joins the
    pieces.
    """
    q_c = qg.split(sizes, dim=3) if len(sizes) > 1 else (qg,)
    base = win.start
    window = (win.k, win.v, win.g)
    pieces = [t.split(C, dim=2) for t in window] if tracked else []  # chunk base // C + j

    def window_of(i: int, lo: int, b: int) -> Tensor:
        """Keys (i=0), values (1) or gates (2) of tokens [lo, b), lo and b in whole chunks."""
        if not tracked:
            return window[i][:, :, lo - base : b - base]
        parts = pieces[i][(lo - base) // C : (b - 1 - base) // C + 1]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    return q_c, window_of


def _merge_left(
    state: KVMState, left: list[Tensor], start: int, norm_weight: Tensor | None,
    norm_bias: Tensor | None, read: tuple[Tensor, Tensor] | None, own: bool,
) -> KVMState:  # fmt: skip
    """The state after the window chunk that starts at token `start` left it: its keys, values
    and gates `left` ((B, Hkv, C, .) each) appended or merged (`update_state`), reusing the
    slots' read-out keys `read` where computed; own: the state's buffers may be written."""
    k_b, v_b, g_b = left
    read_k = None if read is None else read[0]
    return update_state(state, k_b, v_b, g_b, start, norm_weight, norm_bias, read_k, donate=own)


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
    donate: bool = False,
    track_founders: bool = False,
) -> tuple[Tensor, KVMState]:
    """Key-Value Means attention over T new tokens, continuing `state` (None starts a sequence).

    q: (B, H, T, Dk) and k: (B, Hkv, T, Dk) after RoPE; v: (B, Hkv, T, Dv); gate: (B, Hkv, T, 1)
    positive merge gates (None = ones); norm_weight, norm_bias: (Dk,) affine of LN_s;
    window_temp, state_temp: (H,) per-head temperatures; scale: logit scale (1/sqrt(Dk)).
    Returns out (B, H, T, Dv) and the state after the T tokens. Any segmentation of a sequence
    into calls gives the outputs and final state of one call over all of it.

    The given state is never changed, unless donate=True: then its buffers are reused in place
    (merges add into its slots, the window moves within its buffer) and it must not be read
    again; a decode loop that passes each returned state back with donate=True allocates no
    state memory per token once the buffers have grown. track_founders: a sequence started here
    keeps the position of each slot's founding token (`KVMState.founders`).
    """
    dims, gate = check_arguments(
        q, k, v, config, gate, norm_weight, norm_bias, window_temp, state_temp
    )
    if state is None:  # a sequence starts here
        state = empty_state(config, k, v, track_founders)
    state = check_state(state, config, dims, q)

    C, N, n0 = config.chunk_len, config.window_chunks, state.seen
    given = state.slots.store  # written in place only when donated, or once this call copied it
    state, win, cov = _arrive(state, k, v, gate, norm_weight, norm_bias, donate)
    n1 = win.seen  # the window holds tokens [win.start, n1)

    qg = group_heads(q, dims.Hkv)  # (B, Hkv, G, T, Dk)
    # scaled per chunk: a scaled copy of all queries would double a long prefill's memory
    tau_s, tau_w = query_scales(dims, scale, state_temp, window_temp)
    chunks = range(n0 // C, (n1 - 1) // C + 1)
    tracked = records_grad(
        q, k, v, gate, norm_weight, norm_bias, window_temp, state_temp, state.slots.tensor
    )
    sizes = [min(n1, (c + 1) * C) - max(n0, c * C) for c in chunks]
    q_c, window_of = _chunked(qg, sizes, win, C, tracked)

    outs = []  # with autograd; else written into out
    out = None if tracked or len(sizes) == 1 else q.new_empty(*qg.shape[:4], dims.Dv)
    read = None  # the slots' read-out (keys, values) as they stand, once computed
    for i, c in enumerate(chunks):
        a, b = max(n0, c * C), min(n1, (c + 1) * C)  # this call's queries in chunk c
        lo = max(0, (c - N + 1) * C)  # first window token of chunk c
        q_w = q_c[i] * tau_w
        sets = []
        if c >= N:
            if cov < lo:  # the chunk [cov, cov + C) left the window at this chunk's start
                own = donate or state.slots.store is not given
                left = [window_of(j, cov, cov + C) for j in range(3)]
                state = _merge_left(state, left, cov, norm_weight, norm_bias, read, own)
                cov, read = lo, None
            if read is None:
                read = read_state(state, norm_weight, norm_bias)
            sets.append(KeySet(q_w if tau_s is tau_w else q_c[i] * tau_s, *read))
        causal = b - a > 1  # among the chunk's own tokens (one query sees all of them)
        sets.append(KeySet(q_w, window_of(0, lo, b), window_of(1, lo, b), causal))
        if out is None:
            outs.append(attend_key_sets(sets))
        else:
            out[:, :, :, a - n0 : b - n0] = attend_key_sets(sets)
    if out is None:
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    kept = None if read is None else ReadOut(*read, ReadOut.norm_of(norm_weight, norm_bias))
    state = replace(state, window=win.keep_from(window_start(config, n1)), read=kept)
    return ungroup_heads(out), state
