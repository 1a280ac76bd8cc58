"""A document read once and asked many questions (`longkv.document`): answers independent of the
order of the questions and equal to a fresh read's, reads saved and loaded bit for bit, damaged
or foreign saves refused in one line, a killed save never loaded as valid.

The model is a tiny random Llama in float64 with the GPT-2 tokenizer; answers are sampled with a
seed per question, so that they follow the read's logits rather than one greedy token.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import over_tokenizer, tiny_hf
from longkv.caches.kvm_fold import KVMFoldConfig
from longkv.caches.methods import BoundedOptions, make_runner, read_and_answer
from longkv.checks import SettingError
from longkv.decoding import Sampler
from longkv.document import Document, read
from longkv.document.prompt import document_ids, prompt_ids
from longkv.document.save import MANIFEST, STATE, TENSORS, SavedReadError, load
from longkv.train.tokenizer import gpt2_tokenizer

TEXT = " ".join(f"Item {i % 37} lies in room {i % 11}." for i in range(120))
QUESTIONS = [f"Where does item {i} lie?" for i in range(10)]
CHUNKS = {"chunk_size": 128, "stream_chunk": 16}


def method_config(method: str) -> Any:
    """The bounded config of a method at a budget of 128 (None for full and fold)."""
    if method in ("full", "fold"):
        return None
    if method.startswith("two-level"):
        return KVMFoldConfig(budget=128, open=4, leaves=method.partition("/")[2] or "exact")
    ((_, config),) = BoundedOptions(budgets=(128,)).bounded_configs((method,)).items()
    return config


def tiny_model() -> tuple[Any, Any]:
    """A 1-layer random Llama in float64 and the GPT-2 tokenizer."""
    tokenizer = gpt2_tokenizer()
    return tiny_hf(**over_tokenizer(tokenizer), max_position_embeddings=4096).double(), tokenizer


@pytest.fixture(scope="module")
def model_and_tokenizer() -> tuple[Any, Any]:
    return tiny_model()


def answers(doc: Document, questions: list[str]) -> dict[str, list[int]]:
    """Each question's sampled answer tokens (seeded by the question)."""
    out = {}
    for q in questions:
        pick = Sampler(generator=torch.Generator().manual_seed(QUESTIONS.index(q)))
        out[q] = doc.ask(q, 6, pick=pick).tokens
    return out


def fresh(model: Any, tokenizer: Any, method: str, question: str) -> list[int]:
    """The sampled answer of one read of document and question together (`read_and_answer`)."""
    config = method_config(method)
    runner = None if config is None else make_runner(model, config)
    ids = torch.tensor([prompt_ids(tokenizer, TEXT, question)])
    pick = Sampler(generator=torch.Generator().manual_seed(QUESTIONS.index(question)))
    out = read_and_answer(
        model, ids, method.partition("/")[0] if config is None else "bounded", 6, runner=runner,
        eos_token_id=tokenizer.eos_token_id, pick=pick, **CHUNKS,
    )[0].tolist()  # fmt: skip
    return [t for t in out if t != tokenizer.eos_token_id]


METHODS = ["full", "fold", "streaming", "snapkv", "kvm-fold", "two-level", "quest", "infllm"]


@pytest.mark.parametrize("method", METHODS)
def test_ten_questions_in_two_orders_answer_as_fresh_reads(
    model_and_tokenizer: tuple[Any, Any], method: str
) -> None:
    model, tokenizer = model_and_tokenizer
    name = "kvm-fold" if method == "two-level" else method
    doc = read(model, tokenizer, TEXT, name, config=method_config(method), progress=False, **CHUNKS)
    forward = answers(doc, QUESTIONS)
    backward = answers(doc, QUESTIONS[::-1])
    assert forward == backward
    assert len({tuple(a) for a in forward.values()}) > 1  # the answers tell the questions apart
    for q in QUESTIONS[:3]:
        assert forward[q] == fresh(model, tokenizer, method, q), q


@pytest.mark.parametrize("method", METHODS)
def test_a_read_extended_answers_as_a_read_of_the_whole(
    model_and_tokenizer: tuple[Any, Any], method: str
) -> None:
    model, tokenizer = model_and_tokenizer
    name = "kvm-fold" if method == "two-level" else method
    ids = document_ids(tokenizer, TEXT)
    options = {"config": method_config(method), "progress": False, **CHUNKS}
    whole = read(model, tokenizer, ids, name, **options)
    cut = 2 * len(ids) // 3 + 5  # not a multiple of either chunk
    part = read(model, tokenizer, ids[:cut], name, **options)
    before = answers(part, QUESTIONS[:2])
    extended = part.extend(ids[cut:])
    assert extended.tokens == whole.tokens == len(ids)
    assert extended.pending == whole.pending
    assert extended.tokens - len(extended.pending) > part.tokens  # read, not left pending
    assert answers(extended, QUESTIONS[:4]) == answers(whole, QUESTIONS[:4])
    assert answers(part, QUESTIONS[:2]) == before  # the read extended is left as it was


@pytest.mark.parametrize("method", ["fold", "quest"])
def test_a_read_extended_past_the_models_positions_is_refused(
    model_and_tokenizer: tuple[Any, Any], method: str
) -> None:
    model, tokenizer = model_and_tokenizer  # 4096 positions; quest keeps them exact
    doc = read(model, tokenizer, TEXT, method, config=method_config(method), progress=False,
               **CHUNKS)  # fmt: skip
    with pytest.raises(SettingError, match="4096"):
        doc.extend([13] * (4096 - doc.tokens + 1))


@pytest.mark.parametrize(
    "method", ["fold", "streaming", "snapkv", "two-level/exact", "two-level/int8",
               "two-level/file", "quest", "infllm"],
)  # fmt: skip
def test_a_loaded_read_answers_as_the_read_it_saved(
    model_and_tokenizer: tuple[Any, Any], method: str, tmp_path: Path
) -> None:
    model, tokenizer = model_and_tokenizer
    name = method.partition("/")[0].replace("two-level", "kvm-fold")
    doc = read(model, tokenizer, TEXT, name, config=method_config(method), progress=False, **CHUNKS)
    doc.save(tmp_path / "read")
    loaded = load(tmp_path / "read", model, tokenizer)
    assert (loaded.settings, loaded.pending, loaded.tokens) == (
        doc.settings,
        doc.pending,
        doc.tokens,
    )
    assert answers(loaded, QUESTIONS[:4]) == answers(doc, QUESTIONS[:4])
    doc.save(tmp_path / "read")  # a second save replaces the first, leaving nothing beside it
    assert [p.name for p in tmp_path.iterdir()] == ["read"]


def held_tensors(obj: Any, path: str = "", seen: set[int] | None = None) -> dict[str, Any]:
    """Every tensor (a `Rows` as its rows) reachable from obj by path, models left out, with
    the `Rows` or tensor object it was reached as."""
    from longkv.attention.state import Rows

    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, torch.nn.Module):
        return {}
    seen.add(id(obj))
    if isinstance(obj, (torch.Tensor, Rows)):
        return {path: obj}
    if isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif isinstance(obj, dict):
        items = obj.items()
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = vars(obj).items()
    else:
        return {}
    return {k: v for key, x in items for k, v in held_tensors(x, f"{path}/{key}", seen).items()}


@pytest.mark.parametrize("method", ["fold", "snapkv", "two-level/exact", "quest", "infllm"])
def test_a_float32_read_keeps_keys_and_values_in_float16_and_sums_as_held(
    method: str, tmp_path: Path
) -> None:
    """By default a float32 read's keys and values (KV_FIELDS) are saved in float16 and loaded
    as their float32 values rounded to float16; every other tensor (sums, counts, positions) is
    loaded bit for bit; kv_dtype="fp32" keeps every tensor as held."""
    from longkv.attention.state import Rows
    from longkv.document.save import kv_parts

    model, tokenizer = tiny_model()
    model = model.float()
    name = method.partition("/")[0].replace("two-level", "kvm-fold")
    doc = read(model, tokenizer, TEXT, name, config=method_config(method), progress=False, **CHUNKS)
    small, whole = doc.save(tmp_path / "small"), doc.save(tmp_path / "whole", kv_dtype="fp32")
    kv = kv_parts(doc.runner)
    held = held_tensors(doc.runner)
    if method != "fold":  # a bounded runner's cache of its last forward is saved empty
        held = {p: t for p, t in held.items() if not p.startswith("/cache/")}
    narrowed = {p for p, t in held.items() if id(t) in kv and len(t)}
    assert narrowed and (method == "fold" or set(held) - narrowed)  # the fold: K/V alone
    for folder, kv_dtype in ((small, torch.float16), (whole, torch.float32)):
        loaded = held_tensors(load(folder, model, tokenizer).runner)
        assert set(loaded) == set(held)
        for p, t in held.items():
            want, got = (x.tensor if isinstance(x, Rows) else x for x in (t, loaded[p]))
            if p in narrowed and want.is_floating_point():
                want = want.to(kv_dtype).to(want.dtype)
            assert got.dtype == want.dtype and torch.equal(got, want), p
    size = {f.name: (f / TENSORS).stat().st_size for f in (small, whole)}
    assert size["small"] < 0.75 * size["whole"]
    assert json.loads((small / MANIFEST).read_text())["kv_dtype"] == {
        "asked": "auto", "kept": "fp16",
    }  # fmt: skip


def test_keys_past_float16s_range_and_float64_reads_are_saved_as_held(tmp_path: Path) -> None:
    model, tokenizer = tiny_model()
    doc = read(model.float(), tokenizer, TEXT, "streaming", config=method_config("streaming"),
               progress=False, **CHUNKS)  # fmt: skip
    doc.runner.window_k[0] = doc.runner.window_k[0] * 1e6  # past 65504
    loaded = load(doc.save(tmp_path / "big"), model, tokenizer).runner
    assert torch.equal(loaded.window_k[0], doc.runner.window_k[0])
    assert not torch.equal(loaded.window_v[0], doc.runner.window_v[0])  # rounded to float16
    model, tokenizer = tiny_model()  # float64: auto keeps it
    doc = read(model, tokenizer, TEXT, "streaming", config=method_config("streaming"),
               progress=False, **CHUNKS)  # fmt: skip
    loaded = load(doc.save(tmp_path / "f64"), model, tokenizer).runner
    assert torch.equal(loaded.window_v[0], doc.runner.window_v[0])
    loaded = load(doc.save(tmp_path / "bf16", kv_dtype="bf16"), model, tokenizer).runner
    assert torch.equal(loaded.window_v[0], doc.runner.window_v[0].bfloat16().double())
    with pytest.raises(SettingError, match="kv_dtype: must be 'auto' or one of"):
        doc.save(tmp_path / "x", kv_dtype="int8")


@pytest.fixture(scope="module")
def saved_read(
    model_and_tokenizer: tuple[Any, Any], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    model, tokenizer = model_and_tokenizer
    config = method_config("two-level/file")
    doc = read(model, tokenizer, TEXT, "kvm-fold", config=config, progress=False, **CHUNKS)
    return doc.save(tmp_path_factory.mktemp("saved") / "read")


def damaged(saved: Path, tmp_path: Path) -> Path:
    """A copy of the save to damage."""
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(saved), str(copy)], check=True)
    return copy


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda d: flip_byte(d / TENSORS), f"{TENSORS} is corrupted (its checksum differs)"),
        (lambda d: flip_byte(d / "leaves-0.bin"), "leaves-0.bin is corrupted"),
        (lambda d: (d / STATE).write_bytes((d / STATE).read_bytes()[:-7]),
         f"{STATE} is truncated or changed"),
        (lambda d: (d / MANIFEST).unlink(), "no manifest.json, so not a saved read"),
        (lambda d: shutil.rmtree(d), "the folder does not exist"),
        (lambda d: shutil.rmtree(d) or d.write_text(""), "the folder is a file, not a save's"),
        (lambda d: (d / MANIFEST).write_text("{"), "manifest.json is corrupted"),
        (lambda d: edit_manifest(d, longkv="0.0.1"), "saved by longkv 0.0.1, and this is"),
        (lambda d: edit_manifest(d, format=99), "save format 99, and this longkv reads format 3"),
    ],
)  # fmt: skip
def test_a_damaged_save_is_refused_in_one_line(
    model_and_tokenizer: tuple[Any, Any], saved_read: Path, tmp_path: Path, damage: Any, said: str
) -> None:
    model, tokenizer = model_and_tokenizer
    copy = damaged(saved_read, tmp_path)
    load(copy, model, tokenizer)  # whole, it loads
    damage(copy)
    with pytest.raises(SavedReadError) as err:
        load(copy, model, tokenizer)
    assert said in str(err.value) and "\n" not in str(err.value), err.value


def edit_manifest(folder: Path, **values: Any) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, **values}))


def test_another_models_or_tokenizers_save_is_refused(
    model_and_tokenizer: tuple[Any, Any], saved_read: Path
) -> None:
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(1)
    other = type(model)(model.config).double().eval()
    with pytest.raises(SavedReadError, match=r"saved with model .* this model's weights differ"):
        load(saved_read, other, tokenizer)
    changed = gpt2_tokenizer()
    changed.add_tokens(["<longkv-new>"])
    with pytest.raises(SavedReadError, match="saved with another tokenizer than this one"):
        load(saved_read, model, changed)


def test_a_save_runs_no_code_of_its_own(
    model_and_tokenizer: tuple[Any, Any], saved_read: Path, tmp_path: Path
) -> None:
    """A state.pkl naming a function outside longkv's classes is refused, checksums matching."""
    model, tokenizer = model_and_tokenizer
    copy = damaged(saved_read, tmp_path)
    payload = pickle.dumps(os.system)
    (copy / STATE).write_bytes(payload)
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["files"][STATE] = {
        "bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    (copy / MANIFEST).write_text(json.dumps(manifest))
    said = r"state.pkl cannot be read \(holds posix.system, which a read never holds\)"
    with pytest.raises(SavedReadError, match=said):
        load(copy, model, tokenizer)


def test_empty_or_non_text_documents_and_empty_questions_are_refused(
    model_and_tokenizer: tuple[Any, Any],
) -> None:
    model, tokenizer = model_and_tokenizer
    for text, said in (("", "is empty"), (" \n", "is empty"), ("a\x00b", "not text")):
        with pytest.raises(SettingError, match=said):
            read(model, tokenizer, text, "fold", progress=False)
    doc = read(model, tokenizer, TEXT, "fold", progress=False)
    with pytest.raises(SettingError, match="question: is empty"):
        doc.ask("  ")


def test_read_by_default_takes_the_fold_while_the_document_fits_and_infllm_past_it() -> None:
    """`read`'s auto: the exact fold while the document and ASK_ROOM positions fit the model's
    1024, InfLLM@1024 with its positions inside past them; a config without a method refused."""
    tokenizer = gpt2_tokenizer()
    model = tiny_hf(**over_tokenizer(tokenizer), max_position_embeddings=1024).double()
    short = read(model, tokenizer, TEXT[:2000], progress=False, **CHUNKS)  # 590 + 256 tokens
    assert short.settings.method == "fold"
    long = read(model, tokenizer, TEXT + TEXT[:400], progress=False, **CHUNKS)  # 960 + 256
    assert (long.settings.method, long.settings.label) == ("infllm", "infllm/inside@1024")
    with pytest.raises(SettingError, match="config: belongs to the method it configures"):
        read(model, tokenizer, TEXT, config=method_config("streaming"), progress=False)


def test_what_a_model_hosts_is_read_once_for_every_read_and_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fold's, the variants' and the bounded caches' checks read one record of the model
    (`compat.host`), made at its first read, not the model again at each."""
    from longkv.fold import compat

    read_host, calls = compat.read_host, []
    monkeypatch.setattr(compat, "read_host", lambda m: calls.append(m) or read_host(m))
    model, tokenizer = tiny_model()
    for method in ("fold", "streaming", "two-level"):
        name = method.replace("two-level", "kvm-fold")
        doc = read(model, tokenizer, TEXT[:600], name, config=method_config(method),
                   progress=False, **CHUNKS)  # fmt: skip
        doc.ask(QUESTIONS[0], 2)
    assert calls == [model]
    assert compat.host(model).keeps_kv and compat.host(model).takes_cache


def test_an_answer_comes_in_pieces_that_join_into_its_text_cut_where_it_repeats(
    model_and_tokenizer: tuple[Any, Any],
) -> None:
    """`Document.ask`'s on_text pieces join into the answer's text, which is its tokens cut as
    `AnswerWatch` cuts them (GPT-2 has no chat template: the first line); without the stop,
    every token decoded."""
    from longkv.document.repeat import AnswerWatch

    model, tokenizer = model_and_tokenizer
    doc = read(model, tokenizer, TEXT, "fold", progress=False, **CHUNKS)
    for stop in (True, False):
        pieces: list[str] = []
        answer = doc.ask(QUESTIONS[0], 40, on_text=pieces.append, stop_at_repeat=stop)
        assert "".join(pieces) == answer.text
        cut, used = AnswerWatch(tokenizer, one_line=True, stops=stop).cut(answer.tokens)
        assert AnswerWatch.of_prompt(tokenizer, chat=True).one_line  # GPT-2: no template
        assert (answer.text, len(answer.tokens)) == (cut, used)


SAVER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from test_document import CHUNKS, TEXT, method_config, tiny_model
    from longkv.document import read
    model, tokenizer = tiny_model()
    doc = read(model, tokenizer, TEXT, "kvm-fold", config=method_config("two-level/file"),
               progress=False, **CHUNKS)
    print("ready", flush=True)
    while True:
        doc.save({target!r})
    """
)


def test_a_save_killed_at_random_points_never_loads_as_valid(
    model_and_tokenizer: tuple[Any, Any], saved_read: Path, tmp_path: Path
) -> None:
    """Saving over and over in a process killed at a random moment leaves at the target
    either a whole save (which answers as the read) or nothing; a partial one never loads."""
    model, tokenizer = model_and_tokenizer
    expected = answers(load(saved_read, model, tokenizer), QUESTIONS[:2])
    target = tmp_path / "read"
    script = SAVER.format(tests=str(Path(__file__).parent), target=str(target))
    rng = random.Random(0)
    outcomes = set()
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        try:
            got = answers(load(target, model, tokenizer), QUESTIONS[:2])
        except SavedReadError as err:
            assert "no manifest.json" in str(err), err  # the moment between the two renames
            outcomes.add("none")
        else:
            assert got == expected
            outcomes.add("whole")
    assert "whole" in outcomes


def test_every_qa_answer_is_in_the_document_and_scored_by_string_match() -> None:
    from longkv.bench.qa import QUESTIONS, TEXT, correct
    from longkv.data.corpus import read_text

    opening = read_text(TEXT)[:30000].lower()  # 7800 tokens hold over 30000 characters
    assert len(QUESTIONS) >= 10
    for question, accepted in QUESTIONS:
        assert any(a in opening for a in accepted), question
    assert correct("It is Mr. BINGLEY.", ("bingley",)) and not correct("Lucas Lodge", ("bingley",))


def test_bench_document_sets_a_kept_read_against_a_fresh_one(
    model_and_tokenizer: tuple[Any, Any], tmp_path: Path
) -> None:
    from longkv.bench import document as bench

    model, tokenizer = model_and_tokenizer
    s = bench.DocumentBenchSettings(
        tokens=400, methods=("fold", "streaming", "two-level"), leaves=("exact", "file"),
        budget=128, kvm_open=4, chunk_size=128, stream_chunk=16, max_new_tokens=4,
        out_dir=str(tmp_path),
    )  # fmt: skip
    report = bench.run(model, tokenizer, s, [])
    runs = {r["run"]: r for r in report["runs"]}
    assert list(runs) == ["fold", "streaming", "two-level/exact", "two-level/file"]
    assert all(r["equal_to_fresh"] and r["speedup"] > 0 for r in report["runs"] if "fresh" in r)
    assert "fresh" not in runs["two-level/file"]
    for r in runs.values():  # float64: auto keeps the keys and values as held
        assert r["held"]["loaded_equal"] and r["narrow"]["loaded_equal"]
        assert r["held"]["save_bytes"] == r["narrow"]["save_bytes"]
    assert runs["streaming"]["pending_tokens"] == runs["streaming"]["document_tokens"] % 16
    paths = bench.write_page(report, s)
    assert [p.suffix for p in paths] == [".json", ".md", ".png"]
    assert "| kvm-fold/fixed/open4/file@128 |" in paths[1].read_text()


def test_the_package_gives_read_and_load() -> None:
    import longkv
    import longkv.document.save

    assert longkv.read is read and longkv.load is longkv.document.save.load
    with pytest.raises(AttributeError, match="has no attribute 'reed'"):
        longkv.reed  # noqa: B018
