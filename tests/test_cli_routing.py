"""`longkv bench routing` end to end on a tiny random Llama saved with the GPT-2 tokenizer: the
page, its numbers against a direct measurement, resuming from the kept measurements, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import over_tokenizer, saved_model, tiny_hf_config
from longkv.bench import routing
from longkv.caches.bounded import read_prompt
from longkv.caches.methods import make_runner
from longkv.caches.recall import full_attention_at, head_recall, recall
from longkv.cli.main import main
from longkv.evals.niah import answer_span, make_sample
from longkv.models.pretrained import load_pretrained
from longkv.train.tokenizer import gpt2_tokenizer


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder with a 1-layer random Llama (512 positions) and the GPT-2 tokenizer."""
    config = tiny_hf_config(**over_tokenizer(gpt2_tokenizer()), max_position_embeddings=512)
    return saved_model(tmp_path_factory, "tiny", config, LlamaForCausalLM)


def argv(model: str, out: Path, *extra: str) -> list[str]:
    return [
        "bench", "routing", "--model", model, "--tasks", "niah_single_2", "--lengths", "300",
        "--depths", "0.5", "--samples", "1", "--methods", "streaming", "kvm-fold",
        "--budgets", "64", "--window", "28", "--kvm-open", "64", "--leaf-budget", "16",
        "--stream-chunk", "8", "--text-queries", "2", "--out-dir", str(out), "--name", "r",
        *extra,
    ]  # fmt: skip


def test_the_page_holds_each_runs_recall_as_measured_directly(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv(tiny_model, tmp_path)) == 0
    page = capsys.readouterr().out
    assert page.strip() == (tmp_path / "r.md").read_text().strip()
    assert not (tmp_path / "r.partial.json").exists() and (tmp_path / "r.png").is_file()
    parts = json.loads((tmp_path / "r.json").read_text())["parts"]
    assert sorted(parts) == [
        "niah_single_2/300/0.5/0/kvm-fold/fixed/open64@64",
        "niah_single_2/300/0.5/0/streaming@64",
        "text/300/kvm-fold/fixed/open64@64",
        "text/300/streaming@64",
    ]
    # the two-level run's answer recall, measured here the bench's way
    model, tokenizer = load_pretrained(tiny_model)
    sample = make_sample("niah_single_2", tokenizer, 300, 0.5, 0)
    ids = torch.tensor([sample.input_ids])
    last = ids.shape[1] - 1
    full = full_attention_at(model, ids, [last])
    s = routing.RoutingSettings(budgets=(64,), window=28, kvm_open=(64,), leaf_budget=16,
                                stream_chunk=8, methods=("kvm-fold",))  # fmt: skip
    runner = make_runner(model, s.bounded_configs(s.methods)["kvm-fold/fixed/open64@64"])
    runner.watch = {last}
    read_prompt(runner, ids, 8)
    want = recall(
        head_recall(full[last], runner.exact_tokens(last), answer_span(tokenizer, sample))
    )
    got = parts["niah_single_2/300/0.5/0/kvm-fold/fixed/open64@64"]
    assert got["answer"] == pytest.approx(want["answer"], abs=1e-12)
    assert got["entries"] == pytest.approx(want["entries"], abs=1e-12)
    assert parts["niah_single_2/300/0.5/0/streaming@64"]["entries"] == 64  # 4 sinks + 60
    for label in (
        "| streaming@64 | 4 | 60 | - | - | 64 |",
        "| kvm-fold/fixed/open64@64 | 4 | 28 |",
    ):
        assert label in page
    assert "## Answer recall per layer at 300 tokens" in page


def test_an_interrupted_run_resumes_from_its_kept_measurements(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    calls: list[str] = []
    measured = routing.measured

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[5])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return measured(*args, **kwargs)

    monkeypatch.setattr(routing, "measured", counted)
    assert main(argv(tiny_model, tmp_path)) == 130  # Ctrl-C
    assert "the finished measurements are beside the page" in capsys.readouterr().err
    kept = json.loads((tmp_path / "r.partial.json").read_text())["parts"]
    assert len(kept) == 2
    # the measurements do not depend on the folder: moved with the page, they are taken there
    moved = tmp_path / "moved"
    moved.mkdir()
    (tmp_path / "r.partial.json").rename(moved / "r.partial.json")
    calls.clear()
    assert main(argv(tiny_model, moved)) == 0
    assert len(calls) == 2  # the text's two runs alone
    assert main(argv(tiny_model, moved, "--samples", "2")) == 2  # another run's page


def test_snapkv_is_refused_since_its_kept_tokens_are_not_tracked(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = argv(tiny_model, tmp_path)
    bad[bad.index("streaming")] = "snapkv"
    with pytest.raises(SystemExit) as exit_:
        main(bad)
    assert exit_.value.code == 2
    assert "argument --methods: invalid choice: 'snapkv' (choose from 'streaming'" in (
        capsys.readouterr().err
    )
