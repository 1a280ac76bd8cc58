"""OVQAttention: the OVQ layer around `ovq_attention` (spec ovq.md section 1)."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from longkv.attention.layers import AttentionConfig, AttentionLayer, in_state_precision
from longkv.ovq.config import OVQConfig
from longkv.ovq.functional import ovq_attention
from longkv.ovq.state import OVQState


class OVQAttention(AttentionLayer):
    """Online vector-quantised attention layer: the shared shell's projections (no qk
    LayerNorm, no RoPE: OVQ normalises q and k itself and has no positions) and a learnable
    per-head scale beta (init 1; logits beta_h sqrt(Dk) on unit vectors)."""

    def __init__(self, config: AttentionConfig, ovq: OVQConfig) -> None:
        super().__init__(replace(config, qk_norm=False, rope_dim=0))
        self.ovq = ovq
        self.beta = nn.Parameter(torch.ones(config.n_heads))

    def mix(
        self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, state: OVQState | None,
        donate: bool = False,
    ) -> tuple[Tensor, OVQState]:  # fmt: skip
        """ovq_attention, the dictionary in float32 (`in_state_precision`)."""
        return in_state_precision(
            q,
            lambda wide: ovq_attention(
                wide(q), wide(k), wide(v), self.ovq, wide(self.beta), state, donate
            ),
        )
