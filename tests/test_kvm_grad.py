"""Gradients reach every differentiable input; torch.autograd.gradcheck passes."""

from __future__ import annotations

import pytest
import torch

from conftest import make_inputs
from longkv.kvm import KVMConfig, kvm_attention

CONFIG = KVMConfig(
    chunk_len=3, window_chunks=1, sink_len=1, budget="power_law", state_min_len=3,
    growth_factor=2.0, max_state_chunks=None, rope_dim=2,
)  # fmt: skip


@pytest.mark.parametrize("use_vlens", [True, False])
def test_gradients_reach_every_input(use_vlens: bool) -> None:
    config = KVMConfig(**{**CONFIG.__dict__, "use_vlens": use_vlens})
    inp = make_inputs(T=20, Dk=6, Dv=4)
    leaves = {"q": inp.q, "k": inp.k, "v": inp.v, **inp.extras}
    for t in leaves.values():
        t.requires_grad_(True)
    out, state = kvm_attention(inp.q, inp.k, inp.v, config, **inp.extras)
    (out.square().sum() + state.slot_v.sum()).backward()
    for name, t in leaves.items():
        assert t.grad is not None, name
        assert torch.isfinite(t.grad).all(), name
        assert t.grad.abs().sum() > 0, name


def test_gradcheck() -> None:
    inp = make_inputs(B=1, H=2, Hkv=1, T=10, Dk=4, Dv=3, seed=3)
    names = ["q", "k", "v", *inp.extras]
    tensors = [inp.q, inp.k, inp.v, *inp.extras.values()]
    tensors = [t.detach().requires_grad_(True) for t in tensors]

    def fn(*args: torch.Tensor) -> torch.Tensor:
        kw = dict(zip(names, args, strict=True))
        out, _ = kvm_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), CONFIG, **kw)
        return out

    assert torch.autograd.gradcheck(fn, tensors, eps=1e-6, atol=1e-6)


def test_the_merge_gate_is_one_plus_elu_without_its_cancellation() -> None:
    from longkv.kvm.functional import GATE_FLOOR, merge_gate

    x = torch.linspace(-16, 5, 211, dtype=torch.float64)
    # 1 + elu(x) itself loses digits to cancellation below 0 (1e-10 relative at -16)
    torch.testing.assert_close(merge_gate(x), 1 + torch.nn.functional.elu(x), rtol=1e-9, atol=0)
    assert torch.equal(merge_gate(x), torch.where(x < 0, x.exp(), x + 1))
    far = torch.tensor([-40.0, -90.0, -1e4, 1e4], requires_grad=True)
    gate = merge_gate(far)
    assert bool((gate > 0).all()) and float(gate[0].detach()) == pytest.approx(4.248e-18, rel=1e-3)
    assert float(1 + torch.nn.functional.elu(torch.tensor(-40.0))) == 0.0  # what it replaces
    gate.sum().backward()
    assert far.grad is not None and torch.isfinite(far.grad).all()
    assert far.grad.tolist()[1:3] == [0.0, 0.0]  # below the floor: no gradient
    assert bool((merge_gate(torch.tensor([GATE_FLOOR - 1], dtype=torch.bfloat16)) > 0).all())


@pytest.mark.parametrize(("dtype", "logit"), [(torch.float32, -40.0), (torch.bfloat16, -12.0)])
def test_a_model_whose_gates_closed_still_trains_a_step(dtype: torch.dtype, logit: float) -> None:
    """Gate logits driven far below 0 (a model that learned to keep tokens out of the state):
    the gates stay > 0, the loss and every gradient finite, and a step of AdamW runs."""
    from conftest import tiny_longkv

    model = tiny_longkv(["kvm", "kvm"], "fixed").to(dtype).train()
    gates = [block.mixer.gate_proj for block in model.model.layers]
    with torch.no_grad():
        for proj in gates:
            proj.weight.zero_()
            proj.bias.fill_(logit)
    ids = torch.randint(0, 53, (2, 40), generator=torch.Generator().manual_seed(0))
    x = model.model.embed_tokens(ids)
    assert bool((model.model.layers[0].mixer.merge_gates(x) > 0).all())
    loss = model(ids, labels=ids).loss
    assert loss is not None and torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
