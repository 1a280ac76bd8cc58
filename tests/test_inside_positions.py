"""Retrieval caches with positions inside (`longkv.caches.retrieval`): the leaves and read-outs
un-rotated and met at distance window - 1, the sinks and window at their cache index, so that
an input runs past the model's positions; a decoded token's logits against a from-scratch
reference (float64), the positions the model is given, the options and refusals."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import TOL, tiny_hf
from longkv.caches import bounded_fold, make_runner
from longkv.caches.infllm import InfLLMConfig
from longkv.caches.kvm_fold import KVMFoldConfig
from longkv.caches.methods import BoundedOptions, keeps_positions
from longkv.caches.quest import QuestConfig
from longkv.checks import SettingError
from longkv.fold import compat

LIMIT = 64  # the tiny models' positions: every read here runs past them
SPLIT = dict(budget=32, sinks=2, window=16)
CONFIGS = {
    "two-level": KVMFoldConfig(**SPLIT, open=64, positions="inside"),
    "quest": QuestConfig(**SPLIT, page=4, open=64, positions="inside"),
    "infllm": InfLLMConfig(**SPLIT, block=8, representatives=2, open=64, positions="inside"),
}


def ids_of(n: int, seed: int = 0) -> Tensor:
    return torch.randint(0, 97, (1, n), generator=torch.Generator().manual_seed(seed))


def rope(model: torch.nn.Module, x: Tensor, at: Tensor) -> Tensor:
    """x (1, h, n, D) rotated at positions at (n,) by the model's own rotary embedding."""
    cos, sin = model.model.rotary_emb(x, at.view(1, -1))
    return apply_rotary_pos_emb(x, x, cos, sin)[0]


def decoded_logits(model: torch.nn.Module, ids: Tensor, s: int, W: int, window: int,
                   sinks_in_memory: bool) -> Tensor:  # fmt: skip
    """(V,) logits of the last of ids (1, T) under a one-layer Llama, written out: its query
    at cache index P = s + W meets the s sinks at 0 .., the W window tokens before it at s ..
    and its own key at P; the tokens between them (what left the window) un-rotated, met by its
    query rotated at window - 1 (with sinks_in_memory, InfLLM's, the sinks too)."""
    T = ids.shape[1]
    attn, layer = model.model.layers[0].self_attn, model.model.layers[0]
    H, Hkv, D = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
    emb = model.model.embed_tokens(ids)
    x = layer.input_layernorm(emb)
    q0 = attn.q_proj(x[:, -1:]).view(1, 1, H, D).transpose(1, 2)  # (1, H, 1, D)
    k0 = attn.k_proj(x).view(1, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    v = attn.v_proj(x).view(1, T, Hkv, D).transpose(1, 2).repeat_interleave(H // Hkv, 1)
    P = s + W
    local = torch.cat([torch.arange(s), torch.arange(T - 1 - W, T)])  # sinks, window, own
    local_at = torch.cat([torch.arange(s), torch.arange(s, P + 1)])
    memory = torch.arange(s, T - 1 - W)
    if sinks_in_memory:
        memory, local, local_at = torch.arange(T - 1 - W), local[s:], local_at[s:]
    q = rope(model, q0, torch.tensor([P]))
    q_mem = rope(model, q0, torch.tensor([window - 1]))
    logits = torch.cat([
        q @ rope(model, k0[:, :, local], local_at).transpose(-1, -2),
        q_mem @ k0[:, :, memory].transpose(-1, -2),
    ], dim=-1) * attn.scaling  # fmt: skip
    values = torch.cat([v[:, :, local], v[:, :, memory]], dim=2)
    out = (torch.softmax(logits, dim=-1) @ values).transpose(1, 2).reshape(1, 1, H * D)
    h = emb[:, -1:] + attn.o_proj(out)
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.model.norm(h))[0, 0]


@pytest.mark.parametrize("method", list(CONFIGS))
@pytest.mark.parametrize("T", [120, 201])
def test_a_decoded_token_past_the_models_positions_attends_as_written_out(
    method: str, T: int
) -> None:
    """Every unit open (so routing does not matter): the logits of a token decoded after a
    read three times past the model's positions are those of the written-out placement."""
    model = tiny_hf("llama", torch.float64, num_hidden_layers=1, max_position_embeddings=LIMIT)
    config = CONFIGS[method]
    runner = make_runner(model, config)
    ids = ids_of(T)
    bounded_fold(runner, ids[:, :-1], 8)
    with torch.inference_mode():
        got = runner.forward(ids[:, -1:])[0, -1]
    s = runner.sink_k[0].shape[2]
    W = runner.window_count - 1  # the window before the decoded token
    assert s == 2 and 0 < W < config.window_len and T - 1 - W - s > 32  # leaves to open
    with torch.no_grad():
        want = decoded_logits(model, ids, s, W, config.window_len, method == "infllm")
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("method", list(CONFIGS))
def test_no_position_the_model_is_given_leaves_the_budget(
    monkeypatch: pytest.MonkeyPatch, arch: str, method: str
) -> None:
    """A read four times past the model's positions (a hybrid model's sliding layers
    included): no refusal, every position given inside the sinks and window, finite NLL."""
    model = tiny_hf(arch, max_position_embeddings=LIMIT)
    given: list[int] = []
    plain = compat.forward

    def forward(model: torch.nn.Module, ids: Tensor, pos: Tensor, *args: object) -> Tensor:
        given.append(int(pos.max()))
        return plain(model, ids, pos, *args)

    monkeypatch.setattr(compat, "forward", forward)
    result = bounded_fold(make_runner(model, CONFIGS[method]), ids_of(4 * LIMIT, 1), 8)
    # the sinks, then the window, the chunk's last query at its end
    assert len(given) == 4 * LIMIT // 8 and max(given) == SPLIT["sinks"] + SPLIT["window"] - 1
    assert result.nll.shape == (1, 4 * LIMIT - 1) and bool(result.nll.isfinite().all())


def test_the_option_labels_the_runs_and_frees_them_from_the_models_positions() -> None:
    o = BoundedOptions(
        budgets=(32,), sinks=2, window=16, stream_chunk=8, kvm_open=(4,), positions="inside"
    )
    configs = o.bounded_configs(("kvm-fold", "quest", "infllm", "streaming"))
    assert list(configs) == [
        "streaming@32", "quest/inside@32", "infllm/inside@32", "kvm-fold/fixed/open4/inside@32",
    ]  # fmt: skip
    assert not any(keeps_positions(c) for c in configs.values())
    exact = BoundedOptions(budgets=(32,), sinks=2, window=16, stream_chunk=8).bounded_configs(
        ("quest",)
    )
    assert keeps_positions(exact["quest@32"])


@pytest.mark.parametrize(
    ("config", "field", "message"),
    [
        (lambda: KVMFoldConfig(**SPLIT, positions="inside"), "positions", "coarse KVM-Fold"),
        (lambda: KVMFoldConfig(**SPLIT, open=2, positions="inside", slot_key="centred"),
         "slot_key", "leave slot_key rotated"),
        (lambda: QuestConfig(**SPLIT, positions="near"), "positions", "must be one of"),
        (lambda: InfLLMConfig(**SPLIT, positions="near"), "positions", "must be one of"),
    ],
)  # fmt: skip
def test_bad_positions_are_refused_naming_the_field(
    config: object, field: str, message: str
) -> None:
    with pytest.raises(SettingError, match=f"{field}: .*{message}"):
        config()  # type: ignore[operator]


def test_exact_positions_past_the_model_are_refused_naming_the_option() -> None:
    model = tiny_hf("llama", max_position_embeddings=LIMIT)
    runner = make_runner(model, KVMFoldConfig(**SPLIT, open=2))
    with pytest.raises(ValueError, match=r"--positions inside, positions='inside'"):
        bounded_fold(runner, ids_of(2 * LIMIT), 8)
    assert runner.seen == 0
