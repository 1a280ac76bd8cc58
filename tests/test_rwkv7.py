"""RWKV-7 time mixing: the chunked recurrence equals the naive one, gradients flow, the state
stays bounded and continues any segmentation, and bad input is refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AutoModelForCausalLM

from conftest import assert_close, tiny_longkv, unmapped
from longkv.models import LongKVConfig
from longkv.rwkv import (
    RWKV7,
    RWKV7Config,
    RWKV7State,
    rwkv7_recurrence,
    rwkv7_recurrence_naive,
)
from longkv.rwkv.functional import chunk_within_span

V = 53
MAX_DECAY = math.exp(-0.5)  # RWKV-7's log decay lies in (-exp(-0.5), 0)


def inputs(
    B: int, H: int, T: int, Dk: int, Dv: int, seed: int, dtype: torch.dtype = torch.float64,
    log_decay: float = MAX_DECAY,
) -> tuple[Tensor, ...]:  # fmt: skip
    """r, log_w, k, v, kappa (unit per head), iclr in (0, 1), S_0: as an RWKV7 layer makes them."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=dtype)

    log_w = -log_decay * torch.rand(B, H, T, Dk, generator=g, dtype=dtype)
    kappa = F.normalize(randn(B, H, T, Dk), dim=-1)
    iclr = torch.rand(B, H, T, Dk, generator=g, dtype=dtype)
    r, k, v = randn(B, H, T, Dk), randn(B, H, T, Dk), randn(B, H, T, Dv)
    return r, log_w, k, v, kappa, iclr, randn(B, H, Dv, Dk)


@pytest.mark.parametrize(
    ("B", "H", "T", "Dk", "Dv", "C"),
    [
        (2, 3, 37, 8, 6, 16),  # a partial last chunk
        (1, 2, 5, 4, 4, 16),  # shorter than one chunk
        (2, 1, 64, 8, 8, 32),  # whole chunks
        (1, 2, 23, 5, 7, 1),  # one token per chunk
        (3, 2, 40, 6, 3, 7),
    ],
)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_naive(
    B: int, H: int, T: int, Dk: int, Dv: int, C: int, with_state: bool
) -> None:
    *args, S0 = inputs(B, H, T, Dk, Dv, seed=T + C)
    state = S0 if with_state else None
    y, S = rwkv7_recurrence(*args, state=state, chunk_len=C)
    y_ref, S_ref = rwkv7_recurrence_naive(*args, state=state)
    assert y.abs().max().item() > 1.0  # not a vanishing output
    assert_close(y, y_ref)
    assert_close(S, S_ref)


def test_chunked_continues_its_own_state() -> None:
    *args, S0 = inputs(2, 2, 30, 6, 5, seed=3)
    whole, S_whole = rwkv7_recurrence(*args, state=S0, chunk_len=8)
    first, S_first = rwkv7_recurrence(*(a[:, :, :11] for a in args), state=S0, chunk_len=8)
    rest, S_rest = rwkv7_recurrence(*(a[:, :, 11:] for a in args), state=S_first, chunk_len=8)
    assert_close(torch.cat([first, rest], dim=2), whole)
    assert_close(S_rest, S_whole)


def test_float32_keeps_its_range_over_long_chunks_of_strong_decay() -> None:
    """Every token at RWKV-7's strongest decay over 64-token chunks: the chunk's decay
    exp(-38.8) is past float32's precision around 1 and its factors reach exp(19.4), yet the
    result matches float64."""
    *args, S0 = inputs(1, 2, 150, 4, 3, seed=4)
    args[1] = torch.full_like(args[1], -MAX_DECAY)
    y, S = rwkv7_recurrence(*(a.float() for a in args), state=S0.float(), chunk_len=64)
    y_ref, S_ref = rwkv7_recurrence_naive(*args, state=S0)
    assert torch.isfinite(y).all() and y.dtype == torch.float32
    assert_close(y.double(), y_ref, 1e-4)
    assert_close(S.double(), S_ref, 1e-4)


def test_a_chunk_decaying_past_the_factored_range_runs_as_shorter_chunks() -> None:
    """One channel decaying by exp(-12) per token beside channels at exp(-0.01): a 16-token
    chunk spans exp(-192) in that channel, so the recurrence halves the chunk to 4 tokens
    (exp(-48)); float32 stays finite and both precisions match the naive loop. A uniform decay
    sees the same span in every channel; the guard reads the channel that decays most."""
    *args, S0 = inputs(1, 2, 40, 4, 3, seed=4)
    args[1] = torch.full_like(args[1], -0.01)
    args[1][..., 1] = -12.0
    assert chunk_within_span(args[1], 16) == 4 and chunk_within_span(args[1][..., :1], 16) == 16
    y_ref, S_ref = rwkv7_recurrence_naive(*args, state=S0)
    y, S = rwkv7_recurrence(*args, state=S0, chunk_len=16)
    assert_close(y, y_ref)
    assert_close(S, S_ref)
    y32, S32 = rwkv7_recurrence(*(a.float() for a in args), state=S0.float(), chunk_len=16)
    assert torch.isfinite(y32).all() and torch.isfinite(S32).all()
    assert_close(y32.double(), y_ref, 1e-4)
    *args, S0 = inputs(1, 2, 40, 4, 3, seed=4, log_decay=40.0)  # every channel, up to exp(-40)
    assert_close(rwkv7_recurrence(*args, state=S0, chunk_len=16)[0],
                 rwkv7_recurrence_naive(*args, state=S0)[0])  # fmt: skip


def test_a_token_decaying_past_the_factored_range_is_refused() -> None:
    *args, S0 = inputs(1, 2, 6, 4, 3, seed=5)
    args[1][0, 1, 3, 2] = -70.0
    with pytest.raises(ValueError, match=r"log_w: a token decays by exp\(-70.0\) .* clamp log_w"):
        rwkv7_recurrence(*args, state=S0, chunk_len=16)


def test_gradcheck_of_the_chunked_recurrence() -> None:
    args = [a.requires_grad_() for a in inputs(1, 2, 7, 3, 2, seed=5)]
    r, log_w, k, v, kappa, iclr, S0 = args

    def f(*xs: Tensor) -> tuple[Tensor, Tensor]:
        return rwkv7_recurrence(*xs[:6], state=xs[6], chunk_len=3)

    assert torch.autograd.gradcheck(f, (r, log_w, k, v, kappa, iclr, S0))


def test_gradients_reach_every_parameter_of_an_rwkv7_layer() -> None:
    model = tiny_longkv(["rwkv7", "rwkv7"], vocab_size=V)  # layer 1 has the value residual
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(6))
    model(ids, labels=ids).loss.backward()
    for i, block in enumerate(model.model.layers):
        for name, p in block.mixer.named_parameters():
            assert p.grad is not None and p.grad.abs().max().item() > 0, f"layer {i} {name}"
    assert model.model.layers[0].mixer.v0 is None  # the first layer gives v_first
    assert model.model.layers[1].mixer.v0 is not None


def test_the_state_is_bounded_and_moves_rows() -> None:
    model = tiny_longkv(["rwkv7", "swa"], vocab_size=V)
    ids = torch.randint(0, V, (3, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        short, long = model(ids[:, :5]).cache, model(ids).cache
    state = long.layers[0].mixer
    assert isinstance(state, RWKV7State) and state.seen == 40
    assert state.S.shape == (3, 4, 8, 8)  # (B, H, Dv, Dk): nothing grows with the tokens
    assert state.nbytes == short.layers[0].mixer.nbytes == 3 * 4 * 8 * 8 * 8
    assert long.layers[0].last_input is not None  # token shift without config.token_shift
    assert long.layers[1].last_input is None
    rows = state.select_rows(torch.tensor([2, 0]))
    assert torch.equal(rows.S, state.S[[2, 0]]) and rows.batch_size == 2 and rows.seen == 40
    moved = state.to(dtype=torch.float32)
    assert moved.S.dtype == torch.float32 and moved.seen == 40


def test_generate_and_beam_search_with_the_cache_equal_recomputing() -> None:
    model = tiny_longkv(["rwkv7", "kvm", "rwkv7"], vocab_size=V)
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(8))
    for kw in (dict(do_sample=False), dict(num_beams=2, num_return_sequences=2)):
        cached = model.generate(ids, max_new_tokens=8, use_cache=True, **kw)
        scratch = model.generate(ids, max_new_tokens=8, use_cache=False, **kw)
        assert cached.shape[1] == 17 and torch.equal(cached, scratch)


def layer(value_residual: bool = False) -> RWKV7:
    config = RWKV7Config(d_model=16, n_heads=2, head_dim=8, chunk_len=4, value_residual=True)
    return RWKV7(config if value_residual else RWKV7Config(16, 2, 8, 4)).double()


def test_forward_from_the_start_shifts_in_zeros() -> None:
    mixer, x = layer(), torch.randn(2, 9, 16, dtype=torch.float64)
    y, state = mixer(x)
    x_prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
    y_ref, _, _ = mixer.forward_with_values(x, None, x_prev=x_prev)
    assert torch.equal(y, y_ref) and state.seen == 9
    with pytest.raises(ValueError, match="x_prev: an rwkv7 layer continuing a state needs"):
        mixer(x, state)
    with pytest.raises(ValueError, match=r"v_first: an rwkv7 layer after the first needs"):
        layer(value_residual=True)(x)


def test_bad_shapes_are_refused() -> None:
    *args, S0 = inputs(1, 2, 5, 4, 3, seed=9)
    with pytest.raises(ValueError, match=r"state: expected S_0 \(B, H, Dv, Dk\) = \(1, 2, 3, 4\)"):
        rwkv7_recurrence(*args, state=S0.transpose(-1, -2))
    with pytest.raises(ValueError, match="kappa: expected the shape of r"):
        rwkv7_recurrence(*args[:4], args[4][..., :3], args[5])
    with pytest.raises(ValueError, match="chunk_len: must be >= 1"):
        rwkv7_recurrence(*args, chunk_len=0)
    with pytest.raises(ValueError, match=r"RWKV7Config\.head_dim: must be >= 1"):
        RWKV7Config(16, 2, 0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(layout=["rwkv7", "kvm"] * 2, n_kv_heads=2), r"LongKVConfig\.n_kv_heads: rwkv7"),
        (dict(mixer="rwkv7", rwkv_chunk_len=0), r"LongKVConfig\.rwkv_chunk_len: must be >= 1"),
    ],
)
def test_bad_rwkv7_configs_fail_when_built(overrides: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=match):
        LongKVConfig.tiny(**overrides)


def test_save_and_load_reproduce_an_rwkv7_model(tmp_path: Path) -> None:
    model = tiny_longkv(["rwkv7", "swa", "rwkv7"], vocab_size=V)
    with torch.no_grad():
        model.model.layers[2].mixer.r_k.normal_()  # the bonus on, off its init
    model.save_pretrained(tmp_path)
    loaded = unmapped(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval())
    ids = torch.randint(0, V, (1, 13), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_the_recurrence_runs_in_float32_under_bf16_autocast() -> None:
    args = [a.float() for a in inputs(1, 2, 21, 8, 8, seed=11)]
    plain = rwkv7_recurrence(*args[:6], state=args[6])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = rwkv7_recurrence(*args[:6], state=args[6])
    half = rwkv7_recurrence(*(a.bfloat16() for a in args[:6]), state=args[6].bfloat16())
    assert torch.equal(autocast[0], plain[0]) and torch.equal(autocast[1], plain[1])
    assert half[0].dtype == torch.bfloat16 and half[1].dtype == torch.float32
