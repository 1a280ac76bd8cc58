"""SDPA attention that keeps grouped KV heads grouped on the CPU.

transformers' SDPA attention (`sdpa_attention_forward`) repeats each KV head for the query
heads that share it (`repeat_kv`, a copy of a layer's keys and values, G times over) whenever
an attention mask is given, which a fold's every chunk after the first has: a chunk's queries
attend to a cache longer than themselves. On the CPU, torch's SDPA takes the mask and the
grouped heads together (`enable_gqa=True`) without that copy. `gqa_sdpa_attention` does so
there, under the masks transformers makes for SDPA, and leaves every other case to
transformers' function; `use_gqa_sdpa(model)` makes it a loaded model's attention
(`load_model` does, for the models it loads with SDPA).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "longkv_sdpa"
PLAIN = "sdpa"  # the implementation it stands in for


def gqa_sdpa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' SDPA attention, with the KV heads kept grouped where a mask is given on
    the CPU. query (B, H, L, D); key (B, Hkv, Lk, D) and value (B, Hkv, Lk, Dv), H a multiple
    of Hkv; attention_mask (B or 1, 1, L, Lk), boolean or additive. Returns ((B, L, H, Dv),
    None) as transformers' attention functions do."""
    grouped = key.shape[1] != query.shape[1]
    plain = kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
    if attention_mask is None or not grouped or plain or query.device.type != "cpu":
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        enable_gqa=True,
    )  # (B, H, L, Dv)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, gqa_sdpa_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks transformers makes for SDPA


def use_gqa_sdpa(model: nn.Module) -> None:
    """Run `model`'s attention as `gqa_sdpa_attention` if it runs transformers' SDPA now."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == PLAIN:
        model.set_attn_implementation(NAME)
