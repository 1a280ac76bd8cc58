"""The one place that knows how transformers names its cache argument, and which cache a model
carries: transformers' per-layer keys and values, or a longkv model's own LongKVCache.

transformers 5.24 renamed the `past_key_values` argument and output field of causal LMs to
`cache` (the old name warns until 5.40); 5.4 removed `cache_position`, so positions travel
only as `position_ids`. longkv supports transformers >= 5.4 and < 5.40 and is tested on the
version pinned in constraints.txt.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from weakref import WeakKeyDictionary

import torch
import transformers
from packaging.version import Version
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from longkv.fold.packed import PackedLayer, Scratch
from longkv.models import LongKVCache, LongKVForCausalLM

TRANSFORMERS_VERSION = Version(transformers.__version__)
CACHE_ARG = "cache" if TRANSFORMERS_VERSION >= Version("5.24") else "past_key_values"


@dataclass(frozen=True)
class Host:
    """What a model can run, read from its class once (`host`) and carried down: the fold's,
    the variants' and the bounded caches' refusals read it, not the model (its positions are
    its config's, which a command reads before the weights load: `fold.check_positions`)."""

    name: str  # the model's class
    causal: bool  # a decoder alone, not an encoder-decoder
    takes_cache: bool  # its forward takes CACHE_ARG and position_ids
    keeps_kv: bool  # its cache holds keys and values per layer (not a longkv model's
    # LongKVCache of KVM states, window caches and token-shift inputs)


def read_host(model: nn.Module) -> Host:
    """The model's `Host`, read from its class and config."""
    params = inspect.signature(model.forward).parameters
    return Host(
        type(model).__name__, not getattr(model.config, "is_encoder_decoder", False),
        CACHE_ARG in params and "position_ids" in params,
        not isinstance(model, LongKVForCausalLM),
    )  # fmt: skip


HOSTS: WeakKeyDictionary[nn.Module, Host] = WeakKeyDictionary()


def host(model: nn.Module) -> Host:
    """The model's `Host`, read once per model (`read_host`)."""
    found = HOSTS.get(model)
    if found is None:
        found = HOSTS[model] = read_host(model)
    return found


def input_device(model: nn.Module) -> torch.device:
    """Where a model's token ids go: its input embedding's device."""
    return model.get_input_embeddings().weight.device


def new_cache(
    model: nn.Module,
    offload: bool = False,
    packed: torch.dtype | None = None,
    capacity: int = 0,
) -> Cache:
    """An empty cache laid out for the model (sliding-window layers keep their own window).

    offload: keep each layer's keys and values in CPU memory between uses (accelerator only;
    not for a longkv model, whose states are rebuilt at every call).
    packed: keep each full-attention layer's keys and values in storage of this dtype,
    allocated for `capacity` tokens and written in place (`longkv.fold.packed`); None:
    transformers' layers, which concatenate each forward's onto new tensors.
    """
    if host(model).keeps_kv:
        cache = DynamicCache(config=model.config, offloading=offload)
        if packed is not None:
            if offload:
                raise ValueError(
                    "cache_dtype: a packed cache is not offloaded; give one or the other"
                )
            scratch = Scratch()  # the layers run one after another: one widening buffer
            cache.layers = [
                PackedLayer(packed, capacity, scratch) if type(layer) is DynamicLayer else layer
                for layer in cache.layers
            ]
        return cache
    if offload or packed is not None:
        what = "offload_cache" if offload else "cache_dtype"
        raise ValueError(
            f"{what}: {type(model).__name__} carries a LongKVCache of KVM states, which "
            "transformers' offloading and longkv's packed layers do not hold; run without it"
        )
    return LongKVCache(model.config.n_layers)


# what a forward returns: every position's logits (B, L, V), the last position's (B, 1, V), or
# the final hidden states (B, L, d), turned into logits by `head` a block of positions at a time
OUTPUTS = ("logits", "last", "hidden")


def forward(
    model: nn.Module,
    input_ids: Tensor,
    position_ids: Tensor,
    cache: Cache,
    output: str = "logits",
) -> Tensor:
    """The `output` (`OUTPUTS`) of input_ids (B, L) at position_ids (B, L); `cache` grows in
    place."""
    kwargs = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": True}
    kwargs[CACHE_ARG] = cache
    if output == "hidden":
        return model.base_model(**kwargs).last_hidden_state
    if output == "last":
        kwargs["logits_to_keep"] = 1
    elif output != "logits":
        raise ValueError(f"output: {output!r} is not one of {OUTPUTS}")
    return model(**kwargs).logits


def head(model: nn.Module, hidden: Tensor) -> Tensor:
    """Logits (B, n, V) of final hidden states (B, n, d), as the model's forward makes them: its
    output embedding, then its soft-capping where it has one (Gemma's final_logit_softcapping)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap
