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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUP = 32  # input weights per scale
BLOCK = 16384  # output rows an output layer dequantizes at once


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
    return (q.view(out, groups, n_in // groups).to(dtype) * scale.to(dtype)[..., None]).view(
        out, n_in
    )


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
        dtype = embedding.weight.dtype
        return cls(*quantize(embedding.weight, group), dtype, None if extra is None else extra)

    @property
    def weight(self) -> Tensor:
        """The held int8 table (V, d): its device and shape; `dequantize` for values."""
        return self.qweight

    def forward(self, input_ids: Tensor) -> Tensor:
        """(..., d) rows of input_ids (...), in the embedding's dtype."""
        q, scale = self.qweight[input_ids], self.scale[input_ids]  # (..., d), (..., d // g)
        g = self.embedding_dim // scale.shape[-1]
        rows = q.view(*q.shape[:-1], -1, g).to(self.dtype) * scale.to(self.dtype)[..., None]
        rows = rows.view(q.shape)
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
    if head is not None:
        out = Int8Linear(table.qweight, table.scale, None, block) if tied else None
        model.set_output_embeddings(out or Int8Linear.of(head, group, block))
    return model
