"""KVMAttention: the Key-Value Means layer around `kvm_attention` (spec section 8)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor, nn

from longkv.attention.layers import AttentionConfig, AttentionLayer, in_state_precision
from longkv.checks import require
from longkv.kvm.config import KVMConfig
from longkv.kvm.functional import kvm_attention, merge_gate
from longkv.kvm.state import KVMState

ABLATIONS = ("no_vlens", "no_sink", "no_merge_gate", "no_head_temps", "no_append_gate")


class KVMAttention(AttentionLayer):
    """Key-Value Means attention layer.

    On top of the shared shell (projections, qk LayerNorm, partial RoPE on the first
    kvm.rope_dim channels, output projection): the merge gate g = 1 + elu(Linear(x)) with one
    output per KV head, per-head window and state temperatures (init 1), and the state
    LayerNorm LN_s. `merge_gate=False` and `head_temperatures=False` are the paper's
    "no merge gate" and "no head temperatures" ablations; the others live in KVMConfig
    (see `KVMAttention.ablated`). track_founders (off): sequences started by this layer keep
    each slot's founding position (`KVMState.founders`), for analyses of what the state holds.
    """

    track_founders: bool = False

    def __init__(
        self,
        config: AttentionConfig,
        kvm: KVMConfig,
        *,
        merge_gate: bool = True,
        head_temperatures: bool = True,
    ) -> None:
        require(
            config.rope_dim is None or config.rope_dim == kvm.rope_dim,
            config, "rope_dim",
            f"{config.rope_dim} differs from KVMConfig.rope_dim {kvm.rope_dim}; leave it None, "
            "the KVM layer rotates kvm.rope_dim channels",
        )  # fmt: skip
        config = replace(config, rope_dim=kvm.rope_dim)
        kvm.check_head_dim(config.dim)
        super().__init__(config)
        self.kvm = kvm
        H, Hkv, D = config.n_heads, config.kv_heads, config.dim
        self.gate_proj = nn.Linear(config.d_model, Hkv) if merge_gate else None
        self.window_temp = nn.Parameter(torch.ones(H)) if head_temperatures else None
        self.state_temp = nn.Parameter(torch.ones(H)) if head_temperatures else None
        self.state_norm = nn.LayerNorm(D)

    @classmethod
    def ablated(cls, config: AttentionConfig, kvm: KVMConfig, *ablations: str) -> KVMAttention:
        """A layer with the paper's named ablations switched on (any of ABLATIONS)."""
        unknown = set(ablations) - set(ABLATIONS)
        if unknown:
            raise ValueError(f"ablations: unknown {sorted(unknown)}; choose from {ABLATIONS}")
        if "no_vlens" in ablations:
            kvm = replace(kvm, use_vlens=False)
        if "no_sink" in ablations:
            kvm = replace(kvm, sink_len=0)
        if "no_append_gate" in ablations:
            kvm = replace(kvm, gate_appends=False)
        return cls(
            config,
            kvm,
            merge_gate="no_merge_gate" not in ablations,
            head_temperatures="no_head_temps" not in ablations,
        )

    def merge_gates(self, x: Tensor) -> Tensor | None:
        """g = 1 + elu(Linear(x)) (`merge_gate`): x (B, T, d_model) -> (B, Hkv, T, 1), or None
        without a gate."""
        if self.gate_proj is None:
            return None
        return merge_gate(self.gate_proj(x)).transpose(1, 2).unsqueeze(-1)

    def mix(
        self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, state: KVMState | None,
        donate: bool = False,
    ) -> tuple[Tensor, KVMState]:  # fmt: skip
        """kvm_attention with this layer's gates and parameters, its state in float32
        (`in_state_precision`)."""

        def attend(wide: Callable[[Tensor | None], Tensor | None]) -> tuple[Tensor, KVMState]:
            return kvm_attention(
                wide(q), wide(k), wide(v), self.kvm, gate=wide(self.merge_gates(x)),
                state=state, norm_weight=wide(self.state_norm.weight),
                norm_bias=wide(self.state_norm.bias), window_temp=wide(self.window_temp),
                state_temp=wide(self.state_temp), donate=donate,
                track_founders=self.track_founders,
            )  # fmt: skip

        return in_state_precision(q, attend)
