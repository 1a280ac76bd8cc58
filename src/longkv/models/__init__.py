"""Models: longkv's own language models (HF-registered) and pretrained Hugging Face LMs to fold."""

from longkv.models.config import MIXERS, LongKVConfig
from longkv.models.modeling import LongKVCache, LongKVForCausalLM, LongKVModel

__all__ = ["MIXERS", "LongKVCache", "LongKVConfig", "LongKVForCausalLM", "LongKVModel"]
