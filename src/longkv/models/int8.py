"""Weight-only int8: a model's linear layers and token embedding held as int8 with a float32
scale per group of `group` consecutive input weights, dequantized to the compute dtype when
used (a quarter of float32's bytes and an eighth more for the scales).

Symmetric per group: scale = max |w| / 127 over the group, q = round(w / scale) in [-127, 127]
(a group of zeros keeps scale 1), so each weight moves by at most half its group's scale. A
layer's forward dequantizes its whole weight (a layer at a time: the transient is one layer's
float32 weight) and multiplies in the compute dtype, so torch's float32 kernels keep their
speed; an output layer wider than `block` rows (the vocabulary) is dequantized and multiplied
`block` rows at a time. The reference a quantized model is held to: the same model with each
weight replaced by its dequantized value (`dequantize(*quantize(w))`).

A quantized model is kept as one safetensors file of every tensor it holds (`save_int8`) and
built again from it without any float32 weights (`load_int8`: the model made on the meta
device, quantized there for its shapes, then each tensor set from the file), so a process that
loads it never holds the float32 weights.
"""

from __future__ import annotations

import json
from itertools import chain
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

GROUP = 32  # input weights per scale
BLOCK = 4096  # output rows an output layer dequantizes at once (its transient: 4096 x d floats)


def group_of(in_features: int, group: int = GROUP) -> int:
    """The group a layer of in_features inputs is quantized with: `group` where it divides
    them, else one group per row."""
    return group if in_features % group == 0 else in_features


def quantize(weight: Tensor, group: int = GROUP) -> tuple[Tensor, Tensor]:
    """(q, scale) of weight (out, in): q int8 (out, in), scale float32 (out, in // g), g =
    `group_of(in, group)`."""
    out, n_in = weight.shape
    g = group_of(n_in, group)
    w = weight.detach().to(torch.float64).view(out, n_in // g, g)
    scale = (w.abs().amax(dim=-1) / 127).to(torch.float32)  # (out, in // g)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale.to(torch.float64)[..., None]).clamp(-127, 127).to(torch.int8)
    return q.view(out, n_in), scale


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(out, in) weights in dtype of q (out, in) int8 and scale (out, in // g)."""
    out, n_in = q.shape
    groups = scale.shape[-1]
    w = q.view(out, groups, n_in // groups).to(dtype)
    return w.mul_(scale.to(dtype)[..., None]).view(out, n_in)  # in place: one float copy


class Int8Linear(nn.Module):
    """A linear layer y = x W^T + b whose W (out, in) is held as `quantize` gives it."""

    def __init__(self, q: Tensor, scale: Tensor, bias: Tensor | None = None, block: int = BLOCK):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.block = block

    @classmethod
    def of(cls, linear: nn.Linear, group: int = GROUP, block: int = BLOCK) -> Int8Linear:
        """The layer `linear` quantized."""
        return cls(*quantize(linear.weight, group), linear.bias, block)

    @property
    def weight(self) -> Tensor:
        """The held int8 weights (out, in): their device and shape; `dequantize` for values."""
        return self.qweight

    def forward(self, x: Tensor) -> Tensor:
        """(..., out) of x (..., in), in x's dtype."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.out_features <= self.block:
            return F.linear(x, dequantize(self.qweight, self.scale, x.dtype), bias)
        parts = []
        for start in range(0, self.out_features, self.block):
            rows = slice(start, start + self.block)
            w = dequantize(self.qweight[rows], self.scale[rows], x.dtype)
            parts.append(F.linear(x, w, None if bias is None else bias[rows]))
        return torch.cat(parts, dim=-1)


class Int8Embedding(nn.Module):
    """A token embedding whose table (V, d) is held as `quantize` gives it; `embed_scale`
    multiplies each looked-up row (Gemma's sqrt(d), where the embedding had one)."""

    def __init__(self, q: Tensor, scale: Tensor, dtype: torch.dtype, embed_scale: Tensor | None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = q.shape
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.register_buffer("embed_scale", embed_scale)
        self.dtype = dtype

    @classmethod
    def of(cls, embedding: nn.Embedding, group: int = GROUP) -> Int8Embedding:
        """The embedding quantized (its `embed_scale` kept, if it has one)."""
        extra = getattr(embedding, "embed_scale", None)
        return cls(*quantize(embedding.weight, group), embedding.weight.dtype, extra)

    @property
    def weight(self) -> Tensor:
        """The held int8 table (V, d): its device and shape; `dequantize` for values."""
        return self.qweight

    def forward(self, input_ids: Tensor) -> Tensor:
        """(..., d) rows of input_ids (...), in the embedding's dtype."""
        ids = input_ids.reshape(-1)
        rows = dequantize(self.qweight[ids], self.scale[ids], self.dtype)  # (n, d)
        rows = rows.view(*input_ids.shape, self.embedding_dim)
        return rows if self.embed_scale is None else rows * self.embed_scale.to(self.dtype)


def quantize_model(model: nn.Module, group: int = GROUP, block: int = BLOCK) -> nn.Module:
    """Replace, in place, the model's token embedding and every nn.Linear (its output layer
    included, sharing the embedding's int8 table where the two are tied) by their int8 forms;
    returns the model. Norms, biases of other kinds and buffers stay as they are."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embedding.weight
    table = Int8Embedding.of(embedding, group)
    model.set_input_embeddings(table)
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and module is not head:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Int8Linear.of(module, group, block))
    if tied:
        model.set_output_embeddings(Int8Linear(table.qweight, table.scale, None, block))
    elif head is not None:
        model.set_output_embeddings(Int8Linear.of(head, group, block))
    return model


def held_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer of model by name (buffers that are not saved with a state
    dict included: RoPE's inverse frequencies, Gemma's embedding scale), tied ones under each
    of their names."""
    named = chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    return {name: t for name, t in named if t is not None}


def save_int8(model: nn.Module, file: Path) -> None:
    """Write a quantized model's tensors (`held_tensors`) to the safetensors `file`, each storage
    once: a name whose tensor is another's (a tied table) is kept as an alias in the metadata."""
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[Any, ...], str] = {}
    for name, t in held_tensors(model).items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.stride()), t.shape)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
            tensors[name] = t.detach().contiguous()
    save_file(tensors, str(file), metadata={"aliases": json.dumps(aliases)})


def set_tensor(model: nn.Module, name: str, value: Tensor) -> None:
    """Put value in the place of the parameter or buffer called name."""
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def load_int8(file: Path, config: Any) -> nn.Module:
    """The causal LM of `config` (its `PretrainedConfig`), quantized (`quantize_model`), with
    every tensor from the safetensors `file` `save_int8` wrote (computing in the dtype it was
    quantized in), in eval mode, on the CPU."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        quantize_model(model)  # the modules and their tensors' shapes
    with safe_open(str(file), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
        for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
            set_tensor(model, name, f.get_tensor(name))
    held = held_tensors(model)
    for name, target in aliases.items():
        set_tensor(model, name, held[target])
    missing = [name for name, t in held_tensors(model).items() if t.is_meta]
    if missing:
        raise ValueError(f"{file}: holds no {', '.join(missing[:4])}; remove it to quantize again")
    return model.eval()
