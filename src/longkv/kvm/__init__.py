"""Key-Value Means attention: config and state budget, state, the slot arithmetic (shared with
KVM-Fold), chunk-parallel fast path, naive reference, and a fixed-shape decoder."""

from longkv.kvm.config import BudgetRule, KVMConfig, desired_state_len
from longkv.kvm.decode import KVMDecoder, decode_attend
from longkv.kvm.functional import kvm_attention
from longkv.kvm.layer import ABLATIONS, KVMAttention
from longkv.kvm.naive import kvm_attention_naive
from longkv.kvm.state import KVMState

__all__ = [
    "ABLATIONS",
    "BudgetRule",
    "KVMAttention",
    "KVMConfig",
    "KVMDecoder",
    "KVMState",
    "decode_attend",
    "desired_state_len",
    "kvm_attention",
    "kvm_attention_naive",
]
