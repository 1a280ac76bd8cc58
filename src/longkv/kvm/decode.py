"""Token-by-token KVM decoding over fixed-size buffers, so that a decode step has static shapes
and can be compiled (`torch.compile`; on a GPU mode="reduce-overhead" records CUDA graphs).

`KVMDecoder` continues a `KVMState` one token at a time with the outputs of `kvm_attention`:
the window lives in a ring of W = N * C rows (the token at position p in row p mod W), the
slots' read-out in a buffer of `capacity` rows, and whatever a query may not see is masked by
an additive bias, so `decode_attend` always computes over the same shapes. The state update at
a chunk boundary (once per C tokens, data-dependent) stays eager, outside the compiled step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from longkv.attention.core import group_heads, ungroup_heads
from longkv.attention.state import WindowCache
from longkv.kvm.functional import (
    check_arguments,
    found_first,
    query_scales,
    read_state,
    update_state,
)
from longkv.kvm.state import KVMState, ReadOut, covered, window_start


def decode_attend(
    qs: Tensor, qw: Tensor, state_k: Tensor, state_v: Tensor, state_bias: Tensor,
    window_k: Tensor, window_v: Tensor, window_bias: Tensor,
) -> Tensor:  # fmt: skip
    """One softmax over the slots and the window ring for one token's grouped queries.

    qs, qw: (B, Hkv, G, 1, Dk) with scale and temperatures in; state_k (B, Hkv, S, Dk),
    state_v (B, Hkv, S, Dv), state_bias (S,); window_k (B, Hkv, W, Dk), window_v (B, Hkv, W,
    Dv), window_bias (W,): 0 for keys the query sees, -inf for the others. -> (B, Hkv, G, 1, Dv).
    """
    B, Hkv, G, _, Dk = qs.shape
    ls = qs.view(B, Hkv, G, Dk) @ state_k.transpose(-1, -2) + state_bias  # (B, Hkv, G, S)
    lw = qw.view(B, Hkv, G, Dk) @ window_k.transpose(-1, -2) + window_bias  # (B, Hkv, G, W)
    probs = torch.softmax(torch.cat([ls, lw], dim=-1), dim=-1)
    S = state_k.shape[2]
    return (probs[..., :S] @ state_v + probs[..., S:] @ window_v).unsqueeze(3)


class KVMDecoder:
    """Decode one token at a time from a KVM state, over buffers of fixed size.

    state: where to continue (any `KVMState`, e.g. after a prefill); capacity: rows of the
    slots' read-out buffer (default: the state's slots, at least one chunk; it doubles when the
    budget outgrows it, which changes the step's shapes); attend: the step's attention,
    `decode_attend` or a compiled version of it. `step` takes the arguments of
    `kvm_attention` for one token; `to_state` returns the `KVMState` reached.
    """

    def __init__(
        self,
        state: KVMState,
        capacity: int | None = None,
        attend: Callable[..., Tensor] = decode_attend,
    ) -> None:
        self.config, self.attend = state.config, attend
        # its slots are current (a copy the decoder owns) and its read-out is the one in the
        # buffers below; its window is not kept (the ring is)
        self.slots = replace(state, slots=state.slots.copy(), read=None)
        self.seen = state.seen
        window, W = state.window, self.config.window_len
        B, Hkv, _, Dk = window.k.shape
        like = window.k
        self.k = like.new_zeros(B, Hkv, W, Dk)  # row p mod W: the token at position p
        self.v = like.new_zeros(B, Hkv, W, window.v.shape[-1])
        self.g = like.new_ones(B, Hkv, W, 1)
        self.window_bias = like.new_full((W,), float("-inf"))
        rows = self._ring_rows(window.start)
        self.k.index_copy_(2, rows, window.k)
        self.v.index_copy_(2, rows, window.v)
        if window.g is not None:
            self.g.index_copy_(2, rows, window.g)
        self.window_bias[rows] = 0.0
        S = max(capacity or 0, state.num_slots, self.config.chunk_len)
        self.read_k = like.new_zeros(B, Hkv, S, Dk)
        self.read_v = like.new_zeros(B, Hkv, S, window.v.shape[-1])
        self.state_bias = like.new_full((S,), float("-inf"))

    def _ring_rows(self, start: int) -> Tensor:
        """The ring rows of the tokens [start, seen), in time order."""
        pos = torch.arange(start, self.seen, device=self.k.device)
        return pos % self.config.window_len

    def step(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        gate: Tensor | None = None,
        norm_weight: Tensor | None = None,
        norm_bias: Tensor | None = None,
        window_temp: Tensor | None = None,
        state_temp: Tensor | None = None,
        scale: float | None = None,
    ) -> Tensor:
        """The output (B, H, 1, Dv) of the next token: q (B, H, 1, Dk), k (B, Hkv, 1, Dk), v,
        gate (B, Hkv, 1, 1), as `kvm_attention` takes them."""
        dims, gate = check_arguments(
            q, k, v, self.config, gate, norm_weight, norm_bias, window_temp, state_temp
        )
        if dims.T != 1:
            raise ValueError(f"q: KVMDecoder.step takes one token, got {dims.T}; prefill "
                             "with kvm_attention and continue its state")  # fmt: skip
        config, p = self.config, self.seen
        C, N, W = config.chunk_len, config.window_chunks, config.window_len
        c, lo = p // C, max(0, (p // C - N + 1) * C)
        cov = covered(config, p)  # the slots summarise tokens [0, cov)
        state = self.slots
        if p < C:
            state = found_first(state, k, v, norm_weight, norm_bias, donate=True)
        if c >= N and cov < lo:  # the block [cov, cov + C) leaves: its rows are next
            rows = slice(cov % W, cov % W + C)
            state = update_state(
                state, self.k[:, :, rows], self.v[:, :, rows], self.g[:, :, rows], cov,
                norm_weight, norm_bias, donate=True,
            )  # fmt: skip
        i = p % W  # the token's ring row
        if p % C == 0:  # chunk c - N, whose rows chunk c takes, leaves the window
            self.window_bias[i : i + C] = float("-inf")
        self.k[:, :, i], self.v[:, :, i], self.g[:, :, i] = k[:, :, 0], v[:, :, 0], gate[:, :, 0]
        self.window_bias[i] = 0.0
        self.slots, self.seen = state, p + 1
        if c >= N:  # before, no slot is visible: state_bias is -inf throughout
            self._buffer_read_out(norm_weight, norm_bias)
        qg = group_heads(q, dims.Hkv)  # (B, Hkv, G, 1, Dk)
        tau_s, tau_w = query_scales(dims, scale, state_temp, window_temp)
        qs, qw = qg * tau_s, qg * tau_w
        out = self.attend(
            qs, qw, self.read_k, self.read_v, self.state_bias, self.k, self.v, self.window_bias
        )
        return ungroup_heads(out)

    def _buffer_read_out(self, weight: Tensor | None, bias: Tensor | None) -> None:
        """The slots' read-out into the buffers, unless they hold it already (the slots'
        kept read-out matches: every change of the slots drops it)."""
        read = self.slots.read
        if read is not None and read.matches(weight, bias):
            return
        keys, values = read_state(self.slots, weight, bias)
        S = keys.shape[2]
        if S > self.read_k.shape[2]:  # double the buffers: the step's shapes change
            rows = max(S, 2 * self.read_k.shape[2])
            self.read_k = keys.new_zeros(*keys.shape[:2], rows, keys.shape[3])
            self.read_v = values.new_zeros(*values.shape[:2], rows, values.shape[3])
            self.state_bias = keys.new_empty(rows)
        self.read_k[:, :, :S] = keys
        self.read_v[:, :, :S] = values
        self.state_bias.fill_(float("-inf"))
        self.state_bias[:S] = 0.0
        norm = ReadOut.norm_of(weight, bias)
        self.slots = replace(self.slots, read=ReadOut(keys, values, norm))

    def to_state(self) -> KVMState:
        """The `KVMState` after the tokens decoded, to continue with `kvm_attention`."""
        rows = self._ring_rows(window_start(self.config, self.seen))
        window = WindowCache.of(
            self.k.index_select(2, rows), self.v.index_select(2, rows), self.seen,
            self.g.index_select(2, rows),
        )  # fmt: skip
        return replace(self.slots, window=window)
