"""The NIAH runner on the default model, and StreamingLLM's cache after a needle leaves it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import over_tokenizer, tiny_hf
from longkv.caches import StreamingRunner, stream
from longkv.evals.niah import make_sample
from longkv.evals.niah_records import NiahSettings, fold_mismatches
from longkv.evals.niah_report import accuracy_table, heatmap
from longkv.evals.niah_run import run_niah
from longkv.models.pretrained import load_pretrained
from longkv.train.tokenizer import gpt2_tokenizer


@pytest.mark.smollm2
def test_runner_answers_saves_and_resumes(tmp_path: Path) -> None:
    model, tokenizer = load_pretrained()
    settings = NiahSettings(
        tasks=("niah_single_1",), lengths=(1024,), depths=(0.3,), budgets=(256,), max_new_tokens=10
    )
    path = tmp_path / "niah.json"
    run = run_niah(model, tokenizer, settings, path, {"command": "test"})
    assert [r.method for r in run.records] == ["full", "fold", "streaming@256"]
    by = {r.method: r for r in run.records}
    assert by["full"].score == 1.0 and by["fold"].tokens == by["full"].tokens
    assert by["streaming@256"].score == 0.0  # the needle left its 256-entry cache
    assert fold_mismatches(run.records) == []
    saved = json.loads(path.read_text())
    assert saved["fold_equals_full"] and len(saved["records"]) == 3
    assert saved["accuracy"]["niah_single_1/fold/1024"] == 100.0
    assert "| niah_single_1 | streaming@256 | 0.0 | 0.0 |" in accuracy_table(run)
    assert "| task | method | 1024 tokens | mean |" in accuracy_table(run)
    # an interrupted grid (its last answer missing) resumes, keeping the answers it saved, also
    # from a file written before a setting (here `variant`) existed, if that setting is default
    saved["records"] = saved["records"][:2]
    del saved["settings"]["variant"]
    path.write_text(json.dumps(saved))
    resumed = run_niah(model, tokenizer, settings, path)
    assert [r.seconds for r in resumed.records[:2]] == [r["seconds"] for r in saved["records"]]
    assert [r.key for r in resumed.records] == [r.key for r in run.records]
    assert resumed.records[2].tokens == by["streaming@256"].tokens
    # a finished grid is measured again, not replayed
    again = run_niah(model, tokenizer, settings, path)
    assert len(again.records) == 3 and again.records[0].seconds != resumed.records[0].seconds
    heatmap(run, tmp_path / "niah.png", "longkv niah: smollm2, fp32")
    assert (tmp_path / "niah.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="tasks: unknown"):
        NiahSettings(tasks=("niah_single_9",))
    with pytest.raises(ValueError, match="methods: unknown"):
        NiahSettings(methods=("rnn",))
    with pytest.raises(ValueError, match=r"NiahSettings\.window: must be >= 1 \(or unset"):
        NiahSettings(window=0)
    with pytest.raises(ValueError, match=r"NiahSettings\.sinks: must be >= 0, got -1"):
        NiahSettings(sinks=-1)
    with pytest.raises(ValueError, match=r"NiahSettings\.lengths: must be >= 1"):
        NiahSettings(lengths=(4096, 0))
    with pytest.raises(ValueError, match=r"NiahSettings\.depths: must lie in \[0, 1\]"):
        NiahSettings(depths=(0.5, 1.5))
    with pytest.raises(ValueError, match=r"exact_up_to: 2048 is below every length 4096:"):
        NiahSettings(lengths=(4096,), exact_up_to=2048)
    assert NiahSettings(lengths=(4096,), methods=("streaming",), exact_up_to=2048).keys == [
        ("niah_single_2", 4096, d, 0, "streaming@1024") for d in (0.1, 0.5, 0.9)
    ]


@pytest.mark.parametrize(("depth", "inside"), [(0.3, False), (1.0, True)])
def test_a_needle_outside_the_streaming_window_is_absent_from_its_cache(
    depth: float, inside: bool
) -> None:
    tokenizer = gpt2_tokenizer()
    model = tiny_hf(**over_tokenizer(tokenizer), max_position_embeddings=2048)
    sample = make_sample("niah_single_1", tokenizer, 1024, depth, seed=0)
    needle = set(range(sample.needle_positions[0], sample.needle_positions[0] + 20))
    runner = StreamingRunner(model, sinks=4, window=252)
    stream(runner, torch.tensor([sample.input_ids]), 64)
    kept = set(runner.tokens)
    assert len(kept) == runner.position == 256
    assert set(range(4)) <= kept  # the sinks
    assert (needle <= kept) == inside and (needle & kept == set()) == (not inside)
    # the cache itself holds exactly those entries per layer
    assert all(layer.keys.shape[2] == 256 for layer in runner.cache.layers)


def test_the_heatmap_names_model_and_method_with_labels_readable_on_their_cells(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from longkv.evals import niah_report
    from longkv.evals.niah_records import NiahRecord, NiahRun

    s = NiahSettings(tasks=("niah_single_1",), lengths=(1024, 2048), depths=(0.2, 0.8),
                     methods=("full",))  # fmt: skip
    records = [
        NiahRecord("niah_single_1", n, d, 0, "full", ["1"], "", [], score, 1.0)
        for n, d, score in ((1024, 0.2, 1.0), (1024, 0.8, 0.0), (2048, 0.2, 0.5))
    ]
    shown: list[object] = []
    monkeypatch.setattr(niah_report, "save_figure", lambda fig, path, dpi: shown.append(fig))
    niah_report.heatmap(NiahRun(s, records, {}), tmp_path / "h.png", "longkv niah: m, fp32")
    (fig,) = shown
    assert fig._suptitle.get_text() == "longkv niah: m, fp32"  # type: ignore[attr-defined]
    ax = fig.axes[0]  # type: ignore[attr-defined]
    assert ax.get_title() == "niah_single_1 / full"
    labels = {t.get_text(): t.get_color() for t in ax.texts}
    assert labels == {"100": "white", "0": "white", "50": "black"}  # the 2048 / 0.8 cell: none


def test_a_budget_that_holds_every_token_is_refused_or_reported() -> None:
    with pytest.raises(ValueError, match=r"budgets: 8192 holds every token of the longest"):
        NiahSettings(lengths=(4096,), methods=("streaming",), budgets=(8192,))
    s = NiahSettings(lengths=(1024, 4096), methods=("streaming",), budgets=(1024, 2048))
    assert s.whole_budgets() == [
        "budget 1024 holds every token at lengths 1024: the bounded runs answer there as the "
        "fold does",
        "budget 2048 holds every token at lengths 1024: the bounded runs answer there as the "
        "fold does",
    ]
    assert NiahSettings(lengths=(4096,), methods=("full",), budgets=(8192,)).whole_budgets() == []
