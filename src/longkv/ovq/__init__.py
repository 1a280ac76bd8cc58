"""Online vector-quantised attention (OVQ), the KVM paper's baseline: config, state, the chunked
path and its token-by-token reference (docs/ovq.md)."""

from longkv.ovq.config import OVQConfig
from longkv.ovq.functional import ovq_attention
from longkv.ovq.state import OVQState

__all__ = ["OVQConfig", "OVQState", "ovq_attention"]
