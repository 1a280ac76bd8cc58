"""longkv's language models as transformers models: a backbone of pre-LayerNorm blocks over
pluggable token mixers, a causal LM head, and the recurrent cache generation carries.

Positions live in the cache: a call's token t sits at `cache.get_seq_length() + t`. Batches are
unpadded (every row has the same tokens seen), so an attention mask may only hold ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import capture_outputs

from longkv.attention.layers import (
    AttentionLayer,
    BlockSlidingWindowAttention,
    FullAttention,
    SlidingWindowAttention,
)
from longkv.attention.state import WindowCache, tensor_bytes
from longkv.data import IGNORE
from longkv.kvm.layer import KVMAttention
from longkv.kvm.state import KVMState
from longkv.models.config import LongKVConfig
from longkv.ovq.layer import OVQAttention
from longkv.ovq.state import OVQState
from longkv.results import follow_umask, write_atomic
from longkv.rwkv.layer import RWKV7
from longkv.rwkv.state import RWKV7State


@dataclass
class LayerCache:
    """What one layer carries between calls.

    mixer: its token mixer's state (KVMState for kvm layers, OVQState for ovq layers,
    RWKV7State for rwkv7 layers, WindowCache for the others; None before the first token);
    last_input: its normalised input at the last token, (B, d_model), for token shift (rwkv7
    layers always; None in other layers of a model without token shift).
    """

    mixer: KVMState | OVQState | WindowCache | RWKV7State | None = None
    last_input: Tensor | None = None

    def select_rows(self, rows: Tensor) -> None:
        """Keep batch rows `rows` (R,), in that order."""
        if self.mixer is not None:
            self.mixer = self.mixer.select_rows(rows)
        if self.last_input is not None:
            self.last_input = self.last_input.index_select(0, rows.to(self.last_input.device))


class LongKVCache(Cache):
    """The transformers `Cache` of a longkv model: each layer's LayerCache and the tokens seen.

    `generate` uses it like any cache: beam search reorders its rows (`reorder_cache`), and
    `batch_select_indices` / `batch_repeat_interleave` select or repeat them, for every tensor
    of every KVM state, RWKV-7 state and window cache. It cannot be cropped: a KVM state has
    merged the tokens it summarises, so they cannot be taken back out (assisted decoding, which
    crops, does not run). It is never compiled.
    """

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[LayerCache() for _ in range(num_layers)])
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far: the position of the next token."""
        return self.seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: no maximum (KVM states stay bounded, full attention grows)."""
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "cache: a LongKVCache cannot drop tokens (KVM states have merged them); run the "
            "sequence again from an earlier cache instead"
        )

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's state and token-shift input."""
        total = 0
        for layer in self.layers:
            if layer.mixer is not None:
                total += layer.mixer.nbytes
            if layer.last_input is not None:
                total += tensor_bytes(layer.last_input)
        return total

    def reset(self) -> None:
        """Back to an empty sequence."""
        self.layers = [LayerCache() for _ in self.layers]
        self.seen = 0

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep batch rows `indices` (R,), in that order."""
        for layer in self.layers:
            layer.select_rows(indices)

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Beam search: row i continues the beam beam_idx[i]."""
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each batch row `repeats` times in a row: (B, ...) -> (B * repeats, ...)."""
        if self.batch_size > 0:
            self.batch_select_indices(torch.arange(self.batch_size).repeat_interleave(repeats))

    @property
    def batch_size(self) -> int:
        """Batch rows of the states (-1 before the first token)."""
        states = [layer.mixer for layer in self.layers if layer.mixer is not None]
        return states[0].batch_size if states else -1


def build_mixer(config: LongKVConfig, kind: str, layer: int) -> AttentionLayer | RWKV7:
    """The token mixer of layer `layer`."""
    if kind == "rwkv7":
        return RWKV7(config.rwkv7_config(layer))
    shell = config.attention_config(layer)
    if kind == "kvm":  # rotates the kvm.rope_dim channels its state zeroes
        shell = replace(shell, rope_dim=None)
        return KVMAttention.ablated(shell, config.kvm_config(), *config.kvm_ablations)
    if kind == "ovq":  # no RoPE, no qk LayerNorm: the layer sets its shell
        return OVQAttention(shell, config.ovq_config())
    if kind == "full":
        return FullAttention(shell)
    if kind == "swa":
        return SlidingWindowAttention(shell, config.swa_window)
    return BlockSlidingWindowAttention(shell, config.bswa_chunk_len, config.bswa_window_chunks)


class MLP(nn.Module):
    """Linear -> ReLU^2 -> Linear."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.relu(self.up(x)).square())


class Block(nn.Module):
    """x + s * mixer(LN(x)), then x + s * MLP(LN(x)), s = config.residual_scale."""

    def __init__(self, config: LongKVConfig, kind: str, layer: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model)
        self.mixer = build_mixer(config, kind, layer)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config.d_model, config.mlp_ratio * config.d_model)
        self.token_shift = config.token_shift or kind == "rwkv7"  # RWKV-7 always shifts
        self.residual_scale = config.residual_scale

    def forward(
        self,
        x: Tensor,
        state: Any = None,
        last: Tensor | None = None,
        v_first: Tensor | None = None,
        donate: bool = False,
    ) -> tuple[Tensor, Any, Tensor | None, Tensor]:
        """x (B, T, d_model) -> (x, mixer state, last normalised input (B, d_model) or None, v).

        last: the previous call's normalised last token (token shift; None = start of text);
        v_first: the first layer's values (value residual); v: this layer's own values;
        donate: the given state may be changed in place (the caller keeps the returned one).
        """
        h = self.norm1(x)
        h_prev = None
        if self.token_shift:
            before = h.new_zeros(h.shape[0], 1, h.shape[2]) if last is None else last[:, None]
            h_prev = torch.cat([before, h[:, :-1]], dim=1)
        mixed, state, v = self.mixer.forward_with_values(
            h, state, x_prev=h_prev, v_first=v_first, donate=donate
        )
        s = self.residual_scale
        x = x + s * mixed
        last = h[:, -1] if self.token_shift else None
        return x + s * self.mlp(self.norm2(x)), state, last, v


def check_unpadded(attention_mask: Tensor | None) -> None:
    """Raise ValueError unless the mask is absent or all ones (no padding)."""
    if attention_mask is None:
        return
    if attention_mask.dim() != 2 or not bool(attention_mask.bool().all()):
        raise ValueError(
            "attention_mask: longkv models take unpadded batches (a 2D mask of ones); padding "
            "would enter the KVM states and shift every position, so it is refused. Generate "
            "prompts of different lengths one at a time (or batch prompts of equal length)"
        )


def check_positions(position_ids: Tensor | None, seen: int, T: int) -> None:
    """Raise ValueError unless position_ids, when given, are seen, seen + 1, ..., seen + T - 1."""
    if position_ids is None:
        return
    expected = torch.arange(seen, seen + T, device=position_ids.device)
    if position_ids.shape[-1] != T or not bool((position_ids == expected).all()):
        raise ValueError(
            f"position_ids: a longkv model places these {T} tokens at positions {seen}.."
            f"{seen + T - 1} (the cache has seen {seen}); got {position_ids.tolist()}. Positions "
            "live in the cache: leave position_ids out"
        )


# What a saved longkv model holds beside its weights so that transformers loads it with
# trust_remote_code=True in a process that never imported longkv (longkv must be installed):
# config.json's auto_map names these two files, which take the classes from longkv itself.
REMOTE_CODE = {
    "configuration_longkv.py": "from longkv.models.config import LongKVConfig\n",
    "modeling_longkv.py": "from longkv.models.modeling import LongKVForCausalLM, LongKVModel\n",
}
AUTO_MAP = {
    "AutoConfig": "configuration_longkv.LongKVConfig",
    "AutoModel": "modeling_longkv.LongKVModel",
    "AutoModelForCausalLM": "modeling_longkv.LongKVForCausalLM",
}


class LongKVPreTrainedModel(PreTrainedModel):
    """Weight init and the transformers class attributes shared by the longkv models."""

    config_class = LongKVConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True  # per block (`LongKVModel.forward`)
    _no_split_modules: ClassVar[list[str]] = ["Block"]
    _can_record_outputs: ClassVar[dict[str, Any]] = {"hidden_states": Block}

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """transformers' save_pretrained, with config.json's auto_map and the two files it names
        (`REMOTE_CODE`): the folder then loads with `trust_remote_code=True` anywhere longkv is
        installed, as well as after `import longkv.models`. Its files take the user's umask."""
        self.config.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, *args, **kwargs)
        for name, text in REMOTE_CODE.items():
            write_atomic(Path(save_directory) / name, text)
        follow_umask(Path(save_directory))


class LongKVModel(LongKVPreTrainedModel):
    """The backbone: token embedding (and LayerNorm with config.embed_norm), blocks, final
    LayerNorm -> hidden states.

    `activation_checkpointing_enable()` (transformers') makes training keep only each block's
    input and recompute the block in the backward pass."""

    gradient_checkpointing = False  # set by transformers' activation_checkpointing_enable

    def __init__(self, config: LongKVConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_norm = nn.LayerNorm(config.d_model) if config.embed_norm else nn.Identity()
        self.layers = nn.ModuleList(
            Block(config, kind, layer) for layer, kind in enumerate(config.mixers)
        )
        self.norm = nn.LayerNorm(config.d_model)
        self.post_init()

    @capture_outputs
    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: LongKVCache | None = None,
        inputs_embeds: Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """input_ids (B, T) or inputs_embeds (B, T, d_model), continuing `cache` -> hidden states.

        cache: None starts a sequence; a LongKVCache is continued and updated in place (and
        returned unless use_cache=False). attention_mask: ones only (see `check_unpadded`);
        position_ids: if given, must be the cache's next T positions (see `check_positions`).
        Other transformers keyword arguments (output_hidden_states is honoured; e.g.
        output_attentions, which has nothing to return) are accepted and ignored.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids, inputs_embeds: pass exactly one of them")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x = self.embed_norm(x)
        if cache is None:
            cache = LongKVCache(len(self.layers))
        elif not isinstance(cache, LongKVCache):
            raise ValueError(
                f"cache: a longkv model carries a LongKVCache (KVM states and window caches), "
                f"got {type(cache).__name__}; pass None to start or the cache it returned"
            )
        check_unpadded(attention_mask)
        check_positions(position_ids, cache.seen, x.shape[1])
        v_first: Tensor | None = None
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for block, layer in zip(self.layers, cache.layers, strict=True):
            args = (x, layer.mixer, layer.last_input, v_first)
            if recompute:  # the backward pass runs the block again on the same given state:
                # it must find it as it was (donate=False)
                out = self._gradient_checkpointing_func(block.__call__, *args, False)
            else:  # the cache keeps only the new state: the old one's buffers are reused
                out = block(*args, donate=True)
            x, layer.mixer, layer.last_input, v = out
            v_first = v if v_first is None else v_first
        cache.seen += x.shape[1]
        return BaseModelOutputWithPast(
            last_hidden_state=self.norm(x), cache=cache if use_cache is not False else None
        )


class LongKVForCausalLM(LongKVPreTrainedModel, GenerationMixin):
    """Decoder-only LM: the backbone and an untied head; `generate` is transformers' own."""

    def __init__(self, config: LongKVConfig) -> None:
        super().__init__(config)
        self.model = LongKVModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def parameter_counts(self) -> dict[str, int]:
        """Parameters: `embedding` (the token embedding), `head` (the output head), `blocks`
        (all the others, the paper's "block params") and `total`."""
        total = sum(p.numel() for p in self.parameters())
        embedding = self.model.embed_tokens.weight.numel()
        head = self.lm_head.weight.numel()
        blocks = total - embedding - head
        return {"embedding": embedding, "head": head, "blocks": blocks, "total": total}

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """generate must not make a DynamicCache: the forward makes its own LongKVCache."""
        return False

    @can_return_tuple
    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        cache: LongKVCache | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits (B, T', V) of the last logits_to_keep tokens (0 = all T), the cache and a loss.

        Inputs as for `LongKVModel.forward`. labels (B, T): next-token loss over positions
        1..T-1 (labels shifted inside; IGNORE (-100) ignored), in float32 at least.
        """
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        loss = None
        if labels is not None:
            wide = torch.promote_types(logits.dtype, torch.float32)  # bf16 logits: fp32 loss
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).to(wide), labels[:, 1:].flatten(), ignore_index=IGNORE
            )
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, cache=out.cache, hidden_states=out.hidden_states
        )


AutoConfig.register("longkv", LongKVConfig)
AutoModel.register(LongKVConfig, LongKVModel)
AutoModelForCausalLM.register(LongKVConfig, LongKVForCausalLM)
