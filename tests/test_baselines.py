"""Full, sliding-window and block-sliding-window attention: fast path == reference, streaming."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from conftest import assert_close, make_inputs
from longkv.attention import (
    WindowCache,
    block_sliding_window_attention,
    full_attention,
    naive_block_sliding_window_attention,
    naive_full_attention,
    naive_sliding_window_attention,
    sliding_window_attention,
)

Fast = Callable[..., tuple[torch.Tensor, WindowCache]]
CASES: dict[str, tuple[Fast, Callable[..., torch.Tensor]]] = {
    "full": (full_attention, naive_full_attention),
    "swa-1": (
        lambda q, k, v, **kw: sliding_window_attention(q, k, v, 1, **kw),
        lambda q, k, v, **kw: naive_sliding_window_attention(q, k, v, 1, **kw),
    ),
    "swa-7": (
        lambda q, k, v, **kw: sliding_window_attention(q, k, v, 7, **kw),
        lambda q, k, v, **kw: naive_sliding_window_attention(q, k, v, 7, **kw),
    ),
    "bswa-4x2": (
        lambda q, k, v, **kw: block_sliding_window_attention(q, k, v, 4, 2, **kw),
        lambda q, k, v, **kw: naive_block_sliding_window_attention(q, k, v, 4, 2, **kw),
    ),
    "bswa-3x1": (
        lambda q, k, v, **kw: block_sliding_window_attention(q, k, v, 3, 1, **kw),
        lambda q, k, v, **kw: naive_block_sliding_window_attention(q, k, v, 3, 1, **kw),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("Hkv", [1, 4])
def test_fast_equals_reference(name: str, Hkv: int) -> None:
    fast, naive = CASES[name]
    inp = make_inputs(Hkv=Hkv, T=150)
    out, _ = fast(inp.q, inp.k, inp.v, scale=0.3)
    assert_close(out, naive(inp.q, inp.k, inp.v, scale=0.3))


@pytest.mark.parametrize("name", list(CASES))
def test_segmentation_equals_one_call(name: str) -> None:
    fast, _ = CASES[name]
    inp = make_inputs(T=40)
    whole, _ = fast(inp.q, inp.k, inp.v)
    state, outs = None, []
    for a, b in [(0, 9), (9, 10), (10, 27), *((t, t + 1) for t in range(27, 40))]:
        out, state = fast(inp.q[:, :, a:b], inp.k[:, :, a:b], inp.v[:, :, a:b], state=state)
        outs.append(out)
    assert_close(torch.cat(outs, dim=2), whole)
    assert state is not None and state.seen == 40


def test_window_caches_stay_bounded() -> None:
    inp = make_inputs(T=100)
    _, swa = sliding_window_attention(inp.q, inp.k, inp.v, 7)
    _, bswa = block_sliding_window_attention(inp.q, inp.k, inp.v, 4, 2)
    _, full = full_attention(inp.q, inp.k, inp.v)
    assert (swa.start, bswa.start, full.start) == (94, 96, 0)  # what query 100 reads
    per_token = full.nbytes // 100
    assert (swa.nbytes, bswa.nbytes) == (6 * per_token, 4 * per_token)


def test_cache_errors() -> None:
    inp = make_inputs(T=20)
    _, swa = sliding_window_attention(inp.q, inp.k, inp.v, 3)
    with pytest.raises(ValueError, match="state: holds tokens from position 18 but the next query"):
        sliding_window_attention(inp.q[:, :, :1], inp.k[:, :, :1], inp.v[:, :, :1], 9, state=swa)
    with pytest.raises(ValueError, match="state: dtype/device"):
        full_attention(inp.q, inp.k, inp.v, state=swa.to(dtype=torch.float32))
    with pytest.raises(ValueError, match=r"state: holds \(B, Hkv, Dk, Dv\)"):
        full_attention(inp.q[:1], inp.k[:1], inp.v[:1], state=swa)
    with pytest.raises(ValueError, match="window: must be an int >= 1"):
        sliding_window_attention(inp.q, inp.k, inp.v, 0)
    with pytest.raises(ValueError, match="chunk_len: must be an int >= 1"):
        block_sliding_window_attention(inp.q, inp.k, inp.v, 0, 2)
