"""RWKV-7 time mixing: the generalised delta rule (chunked fast path, naive reference), its
carried state and the `RWKV7` token mixer."""

from longkv.rwkv.functional import rwkv7_recurrence
from longkv.rwkv.layer import RWKV7, RWKV7Config
from longkv.rwkv.naive import rwkv7_recurrence_naive
from longkv.rwkv.state import RWKV7State
from longkv.vml import warm_up_vml

warm_up_vml()  # before any threaded VML call: see longkv.vml

__all__ = ["RWKV7", "RWKV7Config", "RWKV7State", "rwkv7_recurrence", "rwkv7_recurrence_naive"]
