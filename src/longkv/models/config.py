"""LongKVConfig: a decoder-only LM whose layers each pick a token mixer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, fields
from typing import Any, ClassVar

from transformers import PreTrainedConfig

from longkv.attention.layers import AttentionConfig
from longkv.checks import require, require_at_least
from longkv.kvm.config import KVMConfig
from longkv.kvm.layer import ABLATIONS
from longkv.ovq.config import OVQConfig
from longkv.rwkv.layer import RWKV7Config

MIXERS = ("full", "swa", "bswa", "kvm", "rwkv7", "ovq")


class LongKVConfig(PreTrainedConfig):
    """Shape and mixers of a longkv language model (kvm.md section 8 backbone).

    layout: one mixer per layer from MIXERS, or None for `mixer` in every layer; kvm: KVMConfig
    fields for the kvm layers; ovq: OVQConfig fields for the ovq layers (online vector-quantised
    attention, no RoPE, no qk LayerNorm); kvm_ablations: the paper's KVM ablations switched on
    in every kvm layer (any of ABLATIONS: no_vlens, no_sink, no_merge_gate, no_head_temps,
    no_append_gate; see `KVMAttention.ablated`); swa_window: tokens an swa layer sees;
    bswa_chunk_len and bswa_window_chunks: the block window of bswa layers; rwkv_chunk_len:
    tokens per chunk of the rwkv7 layers' recurrence (RWKV-7 time mixing with n_heads heads of
    head_dim channels; it needs n_kv_heads == n_heads, always shifts tokens and mixes in the
    first layer's values after the first layer). Pre-LayerNorm blocks, qk LayerNorm (attention
    layers), RoPE (the first kvm.rope_dim channels in kvm layers, `rope_dim` elsewhere, None =
    all), ReLU^2 MLP of mlp_ratio * d_model, untied output head. token_shift and value_residual:
    the optional shell features of AttentionConfig (value residual in every layer after the
    first; value_residual_rank 0: a learned mix per KV head, r > 0: per channel through a rank-r
    gate). residual_scale: each block adds residual_scale * mixer and residual_scale * MLP;
    embed_norm: a LayerNorm after the token embedding; vocab_multiple: vocab_size is rounded up
    to a multiple of it (the paper's 50304 for GPT-2's 50257 tokens at 64). n_kv_heads None is
    stored as n_heads. bos/eos/pad_token_id: the tokenizer's special tokens, which the model's
    generation_config takes (generation stops at eos by default). transformers' usual names read
    and write the same fields (`attribute_map`): hidden_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads.
    """

    model_type = "longkv"
    attribute_map: ClassVar[dict[str, str]] = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads",
    }

    def __init__(
        self,
        vocab_size: int = 50257,
        d_model: int = 256,
        n_layers: int = 4,
        n_heads: int = 4,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        mixer: str = "kvm",
        layout: list[str] | None = None,
        kvm: dict[str, Any] | None = None,
        kvm_ablations: list[str] | None = None,
        ovq: dict[str, Any] | None = None,
        swa_window: int = 256,
        bswa_chunk_len: int = 256,
        bswa_window_chunks: int = 2,
        rwkv_chunk_len: int = 16,
        rope_dim: int | None = None,
        rope_base: float = 10000.0,
        mlp_ratio: int = 4,
        token_shift: bool = False,
        value_residual: bool = False,
        value_residual_rank: int = 0,
        residual_scale: float = 1.0,
        embed_norm: bool = False,
        vocab_multiple: int = 1,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        multiple = max(vocab_multiple, 1)  # validate_longkv refuses one below 1
        self.vocab_size = -(-vocab_size // multiple) * multiple
        self.vocab_multiple = vocab_multiple
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.head_dim = head_dim
        self.mixer = mixer
        self.layout = list(layout) if layout is not None else None
        self.kvm = dict(kvm) if kvm is not None else {}
        self.kvm_ablations = list(kvm_ablations) if kvm_ablations is not None else []
        self.ovq = dict(ovq) if ovq is not None else {}
        self.swa_window = swa_window
        self.bswa_chunk_len = bswa_chunk_len
        self.bswa_window_chunks = bswa_window_chunks
        self.rwkv_chunk_len = rwkv_chunk_len
        self.rope_dim = rope_dim
        self.rope_base = rope_base
        self.mlp_ratio = mlp_ratio
        self.token_shift = token_shift
        self.value_residual = value_residual
        self.value_residual_rank = value_residual_rank
        self.residual_scale = residual_scale
        self.embed_norm = embed_norm
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        self.validate_longkv()

    def validate_longkv(self) -> None:
        """Raise ValueError naming the field and the fix for any inconsistent setting."""
        require_at_least(
            1, self, "vocab_size", "vocab_multiple", "n_layers", "mlp_ratio", "swa_window",
            "bswa_chunk_len", "bswa_window_chunks", "rwkv_chunk_len",
        )  # fmt: skip
        require_at_least(0, self, "value_residual_rank")
        require(
            self.residual_scale > 0, self, "residual_scale",
            f"must be > 0, got {self.residual_scale!r}",
        )  # fmt: skip
        require(
            self.mixer in MIXERS,
            self,
            "mixer",
            f"must be one of {MIXERS}, got {self.mixer!r}",
        )
        require(
            self.layout is None or len(self.layout) == self.n_layers,
            self,
            "layout",
            f"needs one mixer per layer ({self.n_layers}), got {self.layout}",
        )
        bad = sorted(set(self.mixers) - set(MIXERS))
        require(not bad, self, "layout", f"unknown mixers {bad}; choose from {MIXERS}")
        known = {f.name for f in fields(KVMConfig)}
        require(
            set(self.kvm) <= known,
            self,
            "kvm",
            f"unknown KVMConfig fields {sorted(set(self.kvm) - known)}; use {sorted(known)}",
        )
        known_ovq = {f.name for f in fields(OVQConfig)}
        require(
            set(self.ovq) <= known_ovq, self, "ovq",
            f"unknown OVQConfig fields {sorted(set(self.ovq) - known_ovq)}; use "
            f"{sorted(known_ovq)}",
        )  # fmt: skip
        self.ovq_config()  # validates the ovq layers' settings
        unknown = sorted(set(self.kvm_ablations) - set(ABLATIONS))
        require(
            not unknown,
            self,
            "kvm_ablations",
            f"unknown ablations {unknown}; choose from {ABLATIONS}",
        )
        self.attention_config()  # validates the shell
        if "kvm" in self.mixers:
            self.kvm_config().check_head_dim(self.attention_config().dim)
        require(
            "rwkv7" not in self.mixers or self.n_kv_heads == self.n_heads,
            self,
            "n_kv_heads",
            f"rwkv7 layers have one key head per head: set it to n_heads = {self.n_heads} "
            f"(or None), got {self.n_kv_heads}",
        )

    @property
    def mixers(self) -> list[str]:
        """The mixer of each layer."""
        return self.layout if self.layout is not None else [self.mixer] * self.n_layers

    def attention_config(self, layer: int = 0) -> AttentionConfig:
        """The projection / qk-norm / RoPE shell of layer `layer` (kvm layers swap the RoPE)."""
        return AttentionConfig(
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            rope_dim=self.rope_dim,
            rope_base=self.rope_base,
            token_shift=self.token_shift,
            value_residual=self.value_residual and layer > 0,
            value_residual_rank=self.value_residual_rank,
        )

    def rwkv7_config(self, layer: int = 0) -> RWKV7Config:
        """The RWKV7Config of an rwkv7 layer `layer` (value residual after the first layer)."""
        return RWKV7Config(
            d_model=self.d_model,
            n_heads=self.n_heads,
            head_dim=self.attention_config().dim,
            chunk_len=self.rwkv_chunk_len,
            value_residual=layer > 0,
        )

    def kvm_config(self) -> KVMConfig:
        """The KVMConfig of the kvm layers."""
        return KVMConfig(**self.kvm)

    def ovq_config(self) -> OVQConfig:
        """The OVQConfig of the ovq layers."""
        return OVQConfig(**self.ovq)

    @classmethod
    def _from_preset(cls, base: dict[str, Any], overrides: dict[str, Any]) -> LongKVConfig:
        """A preset's fields `base` with `overrides` over them; a `kvm` mapping in overrides
        merges into the preset's kvm (so `kvm={"budget": "fixed"}` changes only the budget).
        Every preset, and so every run file, study and benchmark, builds its model this way."""
        fields = {**base, **overrides}
        if isinstance(overrides.get("kvm"), dict):
            fields["kvm"] = {**base.get("kvm", {}), **overrides["kvm"]}
        return cls(**fields)

    @classmethod
    def tiny(cls, mixer: str = "kvm", **overrides: Any) -> LongKVConfig:
        """4 layers, d=256, 4 heads, C=64: trains on a CPU. KVM defaults to the sqrt budget."""
        kvm = dict(
            chunk_len=64, window_chunks=2, sink_len=1, budget="power_law", state_min_len=64,
            growth_factor=4.0, max_state_chunks=None, rope_dim=32,
        )  # fmt: skip
        base: dict[str, Any] = dict(
            d_model=256, n_layers=4, n_heads=4, mixer=mixer, kvm=kvm, swa_window=128,
            bswa_chunk_len=64, bswa_window_chunks=2,
        )  # fmt: skip
        return cls._from_preset(base, overrides)

    @classmethod
    def paper(cls, size: str = "120m", model: str = "kvm_sqrt16", **overrides: Any) -> LongKVConfig:
        """One of the KVM paper's models (spec training.md 1.5): `size` in PAPER_SIZES (120m: 12
        layers, d=768; 350m: 24 layers, d=1024, residual scale 0.5; 128-channel heads, FFN 4d)
        and `model` in PAPER_MODELS, on the paper's backbone (embedding LayerNorm, token
        shift, value residual with a rank-32 gate, GPT-2's vocabulary padded to 50304)."""
        require(size in PAPER_SIZES, None, "size", f"choose from {sorted(PAPER_SIZES)}")
        require(model in PAPER_MODELS, None, "model", f"choose from {sorted(PAPER_MODELS)}")
        shape = PAPER_SIZES[size]
        base: dict[str, Any] = dict(
            vocab_size=50304, vocab_multiple=64, mlp_ratio=4, token_shift=True,
            value_residual=True, value_residual_rank=32, embed_norm=True, **shape,
            **PAPER_MODELS[model](shape["n_layers"]),
        )  # fmt: skip
        return cls._from_preset(base, overrides)


def _kvm(config: KVMConfig, **fields: Any) -> dict[str, Any]:
    """A model's fields for kvm layers of `config`."""
    return dict(kvm=asdict(config), **fields)


# The KVM paper's model sizes and models (training.md 1.5, ovq.md 7), as LongKVConfig fields:
# each model a function of the layer count. RoPE: 64 of 128 channels in kvm, full and bswa
# layers, all of them in the swa layers of the hybrids (their even layers), none in ovq layers.
PAPER_SIZES: dict[str, dict[str, Any]] = {
    "120m": dict(d_model=768, n_layers=12, n_heads=6, residual_scale=1.0),
    "350m": dict(d_model=1024, n_layers=24, n_heads=8, residual_scale=0.5),
}
PAPER_MODELS: dict[str, Callable[[int], dict[str, Any]]] = {
    "kvm_fixed": lambda n: _kvm(KVMConfig.paper_fixed(), mixer="kvm"),
    "kvm_sqrt16": lambda n: _kvm(KVMConfig.paper_sqrt(), mixer="kvm"),
    "kvm_swa_saturation": lambda n: _kvm(
        KVMConfig.paper_saturation(),
        layout=["swa", "kvm"] * (n // 2) + ["swa"] * (n % 2),
        swa_window=256,
        rope_dim=None,
    ),
    "ovq_swa_saturation": lambda n: dict(
        ovq=asdict(OVQConfig.paper()),
        layout=["swa", "ovq"] * (n // 2) + ["swa"] * (n % 2),
        swa_window=256,
        rope_dim=None,
    ),
    "full": lambda n: dict(mixer="full", rope_dim=64),
    "bswa": lambda n: dict(mixer="bswa", bswa_chunk_len=256, bswa_window_chunks=3, rope_dim=64),
    "rwkv7": lambda n: dict(mixer="rwkv7"),
}
