"""longkv language models: any segmentation gives the same logits; save and load; configs."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from longkv.models import LongKVConfig, LongKVForCausalLM

V, T = 53, 40
KVM = dict(chunk_len=4, window_chunks=2, sink_len=1, state_min_len=4, rope_dim=4)
BUDGETS = {
    "fixed": dict(budget="fixed", max_state_chunks=2, state_min_len=6),
    "sqrt": dict(budget="power_law", growth_factor=3.0, max_state_chunks=None),
    "saturation": dict(
        budget="saturation", saturation_n=16, state_min_len=1, max_state_chunks=None
    ),
}


def tiny(layout: list[str], budget: str = "sqrt", extras: bool = False) -> LongKVForCausalLM:
    """extras: token shift and value residual on."""
    config = LongKVConfig(
        vocab_size=V, d_model=32, n_layers=len(layout), n_heads=4, n_kv_heads=2, layout=layout,
        kvm={**KVM, **BUDGETS[budget]}, swa_window=6, bswa_chunk_len=4, bswa_window_chunks=2,
        token_shift=extras, value_residual=extras,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LongKVForCausalLM(config).double().eval()
    with torch.no_grad():  # LayerNorms, temperatures and mixes off their init
        for name, p in model.named_parameters():
            if any(part in name for part in ("norm", "temp", "shift", "value_mix")):
                p.add_(0.2 * torch.randn_like(p))
    return model


CASES = {
    "full": (["full", "full"], "sqrt"),
    "swa": (["swa", "swa"], "sqrt"),
    "bswa": (["bswa", "bswa"], "sqrt"),
    "kvm-fixed": (["kvm", "kvm"], "fixed"),
    "kvm-sqrt": (["kvm", "kvm"], "sqrt"),
    "kvm-saturation": (["kvm", "kvm"], "saturation"),
    "hybrid": (["kvm", "swa", "kvm", "swa"], "saturation"),
    "hybrid-shift-vres": (["kvm", "swa", "kvm", "bswa"], "fixed", True),
}


def run(model: LongKVForCausalLM, ids: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    cache, logits = None, []
    with torch.no_grad():
        for a, b in itertools.pairwise(cuts):
            out = model(ids[:, a:b], cache=cache)
            cache = out.cache
            logits.append(out.logits)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("case", list(CASES))
def test_any_segmentation_gives_the_same_logits(case: str) -> None:
    model = tiny(*CASES[case])
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    whole = run(model, ids, [0, T])
    decode = run(model, ids, [0, 13, *range(14, T + 1)])
    chunked = run(model, ids, [0, 3, 10, 11, 25, 33, T])
    assert (decode - whole).abs().max().item() <= 1e-10
    assert (chunked - whole).abs().max().item() <= 1e-10


def test_loss_is_next_token_cross_entropy() -> None:
    model = tiny(["kvm", "swa"])
    ids = torch.randint(0, V, (2, T))
    out = model(ids, labels=ids)
    ref = torch.nn.functional.cross_entropy(
        out.logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1)
    )
    assert out.loss is not None and abs(out.loss.item() - ref.item()) <= 1e-12


def test_save_and_load_reproduce_the_logits(tmp_path: Path) -> None:
    model = tiny(["kvm", "swa", "kvm", "swa"], "saturation", extras=True)
    ids = torch.randint(0, V, (1, T))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert isinstance(loaded, LongKVForCausalLM)
    assert torch.equal(run(loaded, ids, [0, T]), run(model, ids, [0, T]))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(mixer="mamba"), r"LongKVConfig\.mixer: must be one of"),
        (dict(layout=["kvm"]), r"LongKVConfig\.layout: needs one mixer per layer"),
        (
            dict(layout=["kvm", "rnn", "kvm", "kvm"]),
            r"LongKVConfig\.layout: unknown mixers \['rnn'\]",
        ),
        (dict(kvm=dict(chunk_len=0)), r"KVMConfig\.chunk_len: must be a positive int"),
        (
            dict(kvm=dict(chunk_size=64)),
            r"LongKVConfig\.kvm: unknown KVMConfig fields \['chunk_size'\]",
        ),
        (dict(n_kv_heads=3), r"AttentionConfig\.n_kv_heads: must divide"),
        (dict(kvm=dict(rope_dim=64)), r"KVMConfig\.rope_dim: 64 >= key head dim 64"),
    ],
)
def test_bad_configs_fail_when_built(overrides: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=match):
        LongKVConfig.tiny(**overrides)


def test_token_shift_and_value_residual_change_the_model() -> None:
    plain, extras = tiny(*CASES["hybrid"]), tiny(*CASES["hybrid"], True)
    assert extras.blocks[0].mixer.value_mix is None  # the first layer's values are v_first
    assert all(b.mixer.value_mix is not None for b in extras.blocks[1:])
    extras.load_state_dict(plain.state_dict(), strict=False)
    ids = torch.randint(0, V, (2, T))
    assert (run(extras, ids, [0, T]) - run(plain, ids, [0, T])).abs().max().item() > 1e-3


def test_presets_build() -> None:
    assert LongKVConfig.tiny().mixers == ["kvm"] * 4
    assert LongKVConfig.paper_120m().kvm_config().budget == "power_law"
    hybrid = LongKVConfig.tiny(layout=["kvm", "swa"] * 2)
    assert hybrid.mixers == ["kvm", "swa", "kvm", "swa"]


@pytest.mark.parametrize("case", ["kvm-sqrt", "hybrid", "full", "hybrid-shift-vres"])
@pytest.mark.parametrize("sample", [False, True])
def test_generate_with_the_cache_equals_recomputing(case: str, sample: bool) -> None:
    model = tiny(*CASES[case])
    ids = torch.randint(0, V, (2, 21), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=15, do_sample=sample, temperature=0.8, top_k=20)

    def gen(use_cache: bool) -> torch.Tensor:
        return model.generate(
            ids, use_cache=use_cache, generator=torch.Generator().manual_seed(3), **kw
        )

    cached, scratch = gen(True), gen(False)
    assert cached.shape == (2, 36) and torch.equal(cached[:, :21], ids)
    assert torch.equal(cached, scratch)


def test_generate_stops_rows_at_eos() -> None:
    model = tiny(["kvm", "swa"])
    ids = torch.randint(0, V, (2, 10))
    free = model.generate(ids, max_new_tokens=6)
    eos = int(free[0, 12])
    out = model.generate(ids, max_new_tokens=6, eos_token_id=eos)
    assert torch.all(out[0, 12:] == eos)
