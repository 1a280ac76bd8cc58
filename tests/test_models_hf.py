"""longkv models as transformers models: generate's standard arguments, pipeline, the cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
    pipeline,
)
from transformers.generation.streamers import BaseStreamer

from conftest import tiny_longkv
from longkv.models import LongKVCache, LongKVConfig, LongKVForCausalLM
from longkv.train.run import model_config
from longkv.train.tokenizer import gpt2_tokenizer

PROMPT = "The cat sat on the mat and looked at"
NEW = 10


@pytest.fixture(scope="module")
def tok() -> Any:
    return gpt2_tokenizer()


@pytest.fixture(scope="module")
def lm(tok: Any) -> LongKVForCausalLM:
    """A KVM and a BSWA layer with token shift, GPT-2's vocabulary and special tokens."""
    return tiny_longkv(
        ["kvm", "bswa"], "fixed", extras=True, vocab_size=len(tok),
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip


def generate(lm: LongKVForCausalLM, enc: Any, use_cache: bool, **kw: Any) -> torch.Tensor:
    torch.manual_seed(7)
    return lm.generate(**enc, max_new_tokens=NEW, use_cache=use_cache, **kw)


MODES = {
    "greedy": {},
    "repetition_penalty": dict(repetition_penalty=1.5),
    "sample": dict(do_sample=True, temperature=0.7, top_k=40, top_p=0.9, num_return_sequences=3),
    "beam": dict(num_beams=2, num_return_sequences=2),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_generate_from_tokenizer_output_equals_recomputing(
    lm: LongKVForCausalLM, tok: Any, mode: str
) -> None:
    enc = tok(PROMPT, return_tensors="pt")  # input_ids and an attention_mask of ones
    T = enc["input_ids"].shape[1]
    cached = generate(lm, enc, True, **MODES[mode])
    scratch = generate(lm, enc, False, **MODES[mode])  # every step one forward from token 0
    rows = MODES[mode].get("num_return_sequences", 1)
    assert cached.shape == (rows, T + NEW)
    assert torch.equal(cached[:, :T], enc["input_ids"].expand(rows, T))
    assert torch.equal(cached, scratch)


def test_beam_search_reorders_the_cache(
    lm: LongKVForCausalLM, tok: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[list[int]] = []
    reorder = LongKVCache.reorder_cache

    def spy(self: LongKVCache, beam_idx: torch.Tensor) -> None:
        seen.append(beam_idx.tolist())
        reorder(self, beam_idx)

    monkeypatch.setattr(LongKVCache, "reorder_cache", spy)
    enc = tok(PROMPT, return_tensors="pt")
    beam = generate(lm, enc, True, num_beams=2)
    assert seen and any(idx != [0, 1] for idx in seen)  # beams swapped or were duplicated
    assert not torch.equal(beam, generate(lm, enc, True))  # a search, not greedy


class Collect(BaseStreamer):
    def __init__(self) -> None:
        self.tokens: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.tokens += value.flatten().tolist()

    def end(self) -> None:
        self.tokens.append(-1)


def test_streamer_gets_the_prompt_then_every_new_token(lm: LongKVForCausalLM, tok: Any) -> None:
    streamer = Collect()
    out = generate(lm, tok(PROMPT, return_tensors="pt"), True, streamer=streamer)
    assert streamer.tokens == [*out[0].tolist(), -1]


class StopAt(StoppingCriteria):
    def __init__(self, length: int) -> None:
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length)


def test_max_length_stopping_criteria_and_generation_config(
    lm: LongKVForCausalLM, tok: Any
) -> None:
    enc = tok(PROMPT, return_tensors="pt")
    T = enc["input_ids"].shape[1]
    full = generate(lm, enc, True)
    assert torch.equal(lm.generate(**enc, max_length=T + 5), full[:, : T + 5])
    stop = StoppingCriteriaList([StopAt(T + 3)])
    assert torch.equal(
        lm.generate(**enc, max_new_tokens=9, stopping_criteria=stop), full[:, : T + 3]
    )
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=tok.eos_token_id)
    assert torch.equal(lm.generate(**enc, generation_config=config), full[:, : T + 4])


def test_generation_stops_at_eos_by_default(tok: Any, tmp_path: Path) -> None:
    model = LongKVForCausalLM(model_config({"d_model": 32, "n_layers": 1, "mixer": "swa"}, tok))
    assert model.generation_config.eos_token_id == tok.eos_token_id == 50256
    with torch.no_grad():  # make <|endoftext|> the most likely token everywhere
        model.lm_head.weight.zero_()
        model.lm_head.weight[tok.eos_token_id] = 1.0
        model.model.norm.bias.fill_(1.0)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["eos_token_id"] == saved["bos_token_id"] == tok.eos_token_id
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    enc = tok(PROMPT, return_tensors="pt")
    out = loaded.generate(**enc, max_new_tokens=8)
    assert out.shape[1] == enc["input_ids"].shape[1] + 1 and out[0, -1] == tok.eos_token_id


def test_left_padding_is_refused(lm: LongKVForCausalLM, tok: Any) -> None:
    tok = tok.__class__.from_pretrained(tok.name_or_path, padding_side="left")
    tok.pad_token = tok.eos_token
    enc = tok([PROMPT, "A cat"], return_tensors="pt", padding=True)
    assert not enc["attention_mask"].all()
    with pytest.raises(ValueError, match="attention_mask: longkv models take unpadded batches"):
        lm.generate(**enc, max_new_tokens=3)


def test_pipeline_returns_the_generated_text(lm: LongKVForCausalLM, tok: Any) -> None:
    pipe = pipeline("text-generation", model=lm, tokenizer=tok)
    text = pipe(PROMPT, max_new_tokens=NEW, do_sample=False)[0]["generated_text"]
    assert text == tok.decode(generate(lm, tok(PROMPT, return_tensors="pt"), True)[0])


def test_usual_config_names_read_and_write_the_fields() -> None:
    config = LongKVConfig.tiny(n_kv_heads=2)
    names = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    assert [getattr(config, n) for n in names] == [256, 4, 4, 2]
    assert LongKVConfig.tiny().num_key_value_heads == 4  # None: one KV head per head
    config.num_hidden_layers = 2
    assert config.n_layers == 2 and config.to_dict()["n_layers"] == 2


def test_embeddings_and_inputs_embeds(lm: LongKVForCausalLM, tok: Any) -> None:
    assert lm.get_input_embeddings() is lm.model.embed_tokens
    assert lm.get_output_embeddings() is lm.lm_head
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        by_ids = lm(ids, output_hidden_states=True)
        by_embeds = lm(inputs_embeds=lm.get_input_embeddings()(ids))
    assert torch.equal(by_ids.logits, by_embeds.logits)
    hidden = by_ids.hidden_states
    assert len(hidden) == lm.config.num_hidden_layers + 1
    assert torch.equal(hidden[0], lm.model.embed_tokens(ids))
    model = tiny_longkv(["kvm", "swa"])
    new = torch.nn.Embedding(53, 32).double()
    model.set_input_embeddings(new)
    assert model.model.embed_tokens is new and model.get_input_embeddings() is new


def test_positions_come_from_the_cache(lm: LongKVForCausalLM) -> None:
    ids = torch.randint(0, 1000, (2, 9))
    with torch.no_grad():
        first = lm(ids[:, :5])
        assert first.cache.get_seq_length() == 5
        ok = lm(ids[:, 5:], cache=first.cache, position_ids=torch.arange(5, 9).expand(2, 4))
        assert first.cache.get_seq_length() == 9 and ok.cache is first.cache  # in place
        with pytest.raises(ValueError, match=r"position_ids: .* at positions 9\.\.10"):
            lm(ids[:, :2], cache=first.cache, position_ids=torch.arange(2)[None])
        with pytest.raises(ValueError, match="cache: a longkv model carries a LongKVCache"):
            lm(ids, cache=torch.nn.Module())  # type: ignore[arg-type]
        assert torch.equal(lm(ids, attention_mask=torch.ones_like(ids)).logits, lm(ids).logits)


ROWS = {"reorder": [2, 0, 0], "repeat": [0, 0, 1, 1, 2, 2]}


@pytest.mark.parametrize("how", list(ROWS))
@pytest.mark.parametrize(
    "layout",
    [["kvm", "swa", "kvm", "bswa"], ["full", "kvm"], ["rwkv7", "kvm", "rwkv7"], ["ovq", "kvm"]],
)
def test_cache_rows_follow_reorder_and_repeat(how: str, layout: list[str]) -> None:
    model = tiny_longkv(layout, "sqrt", extras=True)
    ids = torch.randint(0, 53, (3, 40), generator=torch.Generator().manual_seed(5))
    rows = torch.tensor(ROWS[how])
    with torch.no_grad():
        cache = model(ids[:, :31]).cache
        kvm = cache.layers[layout.index("kvm")].mixer
        assert kvm.num_slots > 0  # the reorder moves slots and window alike
        if how == "reorder":
            cache.reorder_cache(rows)
        else:
            cache.batch_repeat_interleave(2)
        assert cache.batch_size == len(rows)
        continued = model(ids[rows, 31:], cache=cache).logits
        whole = model(ids[rows]).logits[:, 31:]
    assert (continued - whole).abs().max().item() <= 1e-10


def test_cache_cannot_crop_and_resets() -> None:
    model = tiny_longkv(["kvm", "swa"])
    ids = torch.randint(0, 53, (1, 12))
    with torch.no_grad():
        cache = model(ids).cache
        assert not cache.is_croppable and not cache.is_compileable
        with pytest.raises(ValueError, match="cannot drop tokens"):
            cache.crop(-1)
        cache.reset()
        assert cache.get_seq_length() == 0 and cache.batch_size == -1
        assert torch.equal(model(ids, cache=cache).logits, model(ids).logits)
