"""InfLLM's blocks as a retrieval cache: a forward's attention and the attention its local
tokens receive are the per-query reference (the memory un-rotated and met at window - 1);
representatives and block choice against their references; no memory is the exact fold; bad
settings are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from conftest import TOL, tiny_hf
from longkv.attention.rope import angles_at, rotate
from longkv.caches import bounded_fold, bounded_generate, make_runner
from longkv.caches.infllm import InfLLMConfig, InfLLMRunner, block_scores, representatives
from longkv.caches.naive import infllm_attention_naive, representatives_naive, top_units_naive
from longkv.fold import kv_fold


def ids_of(n: int = 90) -> Tensor:
    return torch.randint(0, 64, (2, n), generator=torch.Generator().manual_seed(5))


def config(**more: Any) -> InfLLMConfig:
    return InfLLMConfig(**{"budget": 26, "sinks": 2, "window": 16, "block": 4, **more})


def test_representatives_are_the_mean_keys_of_each_heads_most_attended_tokens() -> None:
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 7, 5, generator=g, dtype=torch.float64)
    scores = torch.rand(2, 4, 7, generator=g, dtype=torch.float64)
    scores[0, 1, 2] = scores[0, 1, 5]  # a tie: the earlier token
    for r in (1, 3, 7):
        got = representatives(keys, scores, r)
        torch.testing.assert_close(got, representatives_naive(keys, scores, r), rtol=0, atol=TOL)


@pytest.mark.parametrize("chunk", [8, 1])
def test_a_forwards_attention_and_the_attention_received_are_the_per_query_reference(
    chunk: int,
) -> None:
    """Spy on each layer's attention of one more forward after a read: against the reference
    with the blocks it chose (the best `open` by representatives, the newest while not full),
    its output and the attention its window and chunk tokens received, in float64."""
    model, ids = tiny_hf("llama", torch.float64), ids_of(90 + chunk)
    runner = make_runner(model, config(open=2))
    assert isinstance(runner, InfLLMRunner)
    bounded_fold(runner, ids[:, :90], 8)
    seen: dict[int, tuple[Any, ...]] = {}
    attend = runner.attend

    def spy(layer: int) -> Any:
        inner = attend(layer)
        store, reps = runner.leaves[layer], runner.reps[layer]
        assert store is not None and reps is not None
        before, (sinks, _, window) = runner.received[layer], runner.parts(layer)

        def run(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
            every = store.gather(None, torch.float64)
            out = inner(q, keys, values, scale)
            seen[layer] = (q, keys, values, scale, every, reps, before, out, sinks, window)
            return out

        return run

    runner.attend = spy  # type: ignore[method-assign]
    with torch.inference_mode():  # as every read
        runner.forward(ids[:, 90:])
    layer = 1
    q, keys, values, scale, every, reps, before, out, sinks, window = seen[layer]
    L, W = chunk, window.keys.shape[2]
    assert keys.shape[2] == L  # the model's cache holds the chunk alone
    positions = torch.arange(90, 90 + L)
    cos, sin = angles_at(15 - positions, runner.inv_freqs[0])
    q_mem = rotate(q, cos, sin)  # every query at window - 1
    full = reps.shape[2]
    score = block_scores(q_mem, reps)  # (B, full)
    torch.testing.assert_close(
        score,
        torch.einsum("bhd,bhud->bu", q_mem.mean(2), reps),
        rtol=0, atol=TOL,
    )  # fmt: skip
    cos0, sin0 = angles_at(-torch.arange(2), runner.inv_freqs[0])
    sinks_k = rotate(sinks.keys, cos0, sin0)  # the initial tokens without their rotation
    for b in range(2):
        chosen = set(top_units_naive(score[b], 2)) | {u for u in range(full, 99)}
        mine = [j for j in range(every.keys.shape[2]) if int(every.owner[b, 0, j]) in chosen]
        entries = {
            "memory": (
                torch.cat([sinks_k[b : b + 1], every.keys[b : b + 1, :, mine]], dim=2),
                torch.cat([sinks.values[b : b + 1], every.values[b : b + 1, :, mine]], dim=2),
            ),
            "window": (window.keys[b : b + 1], window.values[b : b + 1]),
            "chunk": (keys[b : b + 1], values[b : b + 1]),
        }
        want, received = infllm_attention_naive(q[b : b + 1], q_mem[b : b + 1], entries, scale)
        torch.testing.assert_close(out[b : b + 1], want, rtol=0, atol=TOL)
        after = runner.received[layer]
        assert before is not None and after is not None
        expect = torch.cat([before[b : b + 1] + received[:, :, :W], received[:, :, W:]], dim=2)
        torch.testing.assert_close(after[b : b + 1].double(), expect, rtol=0, atol=1e-6)


def test_blocks_form_as_tokens_leave_each_with_its_representatives_and_are_retrieved() -> None:
    model, ids = tiny_hf("llama"), ids_of()
    runner = make_runner(model, config(representatives=2, open=3))
    assert isinstance(runner, InfLLMRunner)
    bounded_generate(runner, ids, 8, 4)
    store, reps, pending = runner.leaves[0], runner.reps[0], runner.pending[0]
    assert store is not None and reps is not None and pending is not None
    assert reps.shape[2] == len(store) // 4 and pending[0].shape[2] == len(store) % 4
    assert store.owner.tensor[0, 0, :, 0].tolist() == [j // 4 for j in range(len(store))]
    opened = runner.last_opened[0]  # the last decoded token's blocks: 3 full + the newest
    assert opened is not None
    assert int(opened[0, 0].sum()) == 3 + (len(store) % 4 > 0)
    share = runner.attention_share(since=90)
    assert 0 < share["mean"] < 1


def test_with_no_memory_infllm_is_the_exact_fold() -> None:
    """No initial tokens and a window that holds the whole input: only the local part."""
    model, ids = tiny_hf("qwen2"), ids_of(40)
    exact = kv_fold(model, ids, 40, return_logits=True).logits
    runner = make_runner(model, InfLLMConfig(budget=80, sinks=0, window=48, block=4))
    run = bounded_fold(runner, ids, 8, return_logits=True).logits
    assert run is not None and exact is not None
    assert (run - exact).abs().max().item() <= 1e-5


@pytest.mark.parametrize("field", ["block", "representatives", "open"])
def test_bad_settings_are_refused_naming_the_field(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}: must be >= 1"):
        config(**{field: 0})
