"""The `longkv` command line itself: help, options made from settings, errors, where results go.

The model commands run on a tiny random Llama saved with the shared GPT-2 tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from conftest import over_tokenizer, saved_model, tiny_hf_config
from longkv.bench.bounded import FATES, fate_rows, miss_rows, route_rows
from longkv.bench.kvm import BenchSettings
from longkv.bench.train import TrainBenchSettings
from longkv.caches.methods import BOUNDED
from longkv.cli import common
from longkv.cli import fold as fold_cli
from longkv.cli import niah as niah_cli
from longkv.cli.args import build_settings
from longkv.cli.main import COMMANDS, build_parser, main
from longkv.evals import niah_run
from longkv.evals.niah_records import NiahRecord, NiahSettings
from longkv.fold import drift_grid
from longkv.results import OUT_DIR, save_partial
from longkv.train.tokenizer import gpt2_tokenizer
from longkv.version import __version__

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder with a 1-layer random Llama (512 positions) and the GPT-2 tokenizer."""
    config = tiny_hf_config(**over_tokenizer(gpt2_tokenizer()), max_position_embeddings=512)
    return saved_model(tmp_path_factory, "tiny", config, LlamaForCausalLM)


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder with a 1-layer random GPT-2 (512 learned positions) and its tokenizer."""
    tokenizer = gpt2_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2, n_positions=512,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    return saved_model(tmp_path_factory, "tiny_gpt2", config, GPT2LMHeadModel)


@pytest.fixture
def answers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The methods niah_run.answer was called with, in order (the calls still run)."""
    calls: list[str] = []
    answer = niah_run.answer

    def counted(model, ids, method, s, eos, *rest):  # type: ignore[no-untyped-def]
        calls.append(method)
        return answer(model, ids, method, s, eos, *rest)

    monkeypatch.setattr(niah_run, "answer", counted)
    return calls


def leaf_parsers(command: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(name, parser) of the command and of every subcommand under it."""
    parser = build_parser(command)
    todo = [(command, parser._subparsers._group_actions[0].choices[command])]  # type: ignore[union-attr]
    while todo:
        name, p = todo.pop()
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield name, p
        for sub in subs:
            todo += [(f"{name} {n}", q) for n, q in sub.choices.items()]


def test_top_level_help_lists_the_commands_without_importing_torch() -> None:
    code = (
        "import sys\n"
        "from longkv.cli.main import main\n"
        "try:\n    main(['--help'])\n"
        "except SystemExit as e:\n    assert e.code == 0\n"
        "heavy = [m for m in ('torch', 'transformers', 'longkv.cli.niah') if m in sys.modules]\n"
        "print('imported:', heavy)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert out.strip().endswith("imported: []"), out
    assert all(name in out for name in COMMANDS)


def test_top_level_help_names_every_bounded_method_and_benchmark() -> None:
    assert all(method in COMMANDS["bounded"][1] for method in BOUNDED)
    benches = [name.split()[1] for name, _ in leaf_parsers("bench")]
    assert len(benches) > 1 and all(name in COMMANDS["bench"][1] for name in benches)


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"longkv {__version__}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help_and_shows_its_default_once(command: str) -> None:
    for name, parser in leaf_parsers(command):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"longkv {name} {action.option_strings or action.dest}: no help"
            shown = formatter._expand_help(action)
            assert shown.count("default") <= 1, f"longkv {name}: {shown!r}"
            assert "(default: )" not in shown, f"longkv {name}: {shown!r} shows an empty default"
            if action.default not in (None, (), []) and action.nargs != 0 and not action.required:
                assert "default" in shown, f"longkv {name}: {shown!r} hides its default"
        assert parser.format_help()


@pytest.mark.parametrize(
    ("argv", "classes"),
    [
        (["niah"], [common.ModelOptions, niah_cli.NiahOptions, NiahSettings]),
        (["fold"], [common.ModelOptions, fold_cli.FoldOptions]),
        (["drift"], [common.ModelOptions, fold_cli.DriftOptions]),
        (["bench", "kvm"], [BenchSettings]),
        (["bench", "train"], [TrainBenchSettings]),
    ],
)
def test_options_are_made_from_the_settings_and_keep_their_defaults(
    argv: list[str], classes: list[type]
) -> None:
    args = build_parser(argv[0]).parse_args(argv)
    build_settings(args)
    assert list(args.settings) == classes
    leaf = dict(leaf_parsers(argv[0]))[" ".join(argv)]
    actions = {s: a for a in leaf._actions for s in a.option_strings}
    for cls in classes:
        assert args.settings[cls] == cls()
        for f in fields(cls):
            action = actions["--" + f.name.replace("_", "-")]
            assert action.dest == f.name and action.help.startswith(f.metadata["help"])
            assert action.choices == f.metadata["choices"]


def test_a_given_option_reaches_its_setting() -> None:
    argv = ["bench", "kvm", "--lengths", "64", "128", "--no-keep-heap", "--decode-tokens", "3"]
    args = build_parser("bench").parse_args(argv)
    build_settings(args)
    assert args.settings[BenchSettings] == BenchSettings(
        lengths=(64, 128), keep_heap=False, decode_tokens=3
    )


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["niah", "--window", "0"], "--window"),
        (["niah", "--budgets", "100", "--stream-chunk", "200"], "--stream-chunk"),
        (["niah", "--methods", "kvm-fold", "--budgets", "8", "--window", "4"], "--window"),
        (["niah", "--depths", "0.5", "2"], "--depths"),
        (["fold", "--tokens", "0"], "--tokens"),
        (["drift", "--chunk-sizes", "0"], "--chunk-sizes"),
        (["bench", "kvm", "--head-dim", "2"], "--head-dim"),
        (["bench", "train", "--repeats", "0"], "--repeats"),
        # refused by the config an option feeds (KVMFoldConfig), named as that option
        (["niah", "--methods", "kvm-fold", "--kvm-growth-factor", "-1"], "--kvm-growth-factor"),
        (["niah", "--methods", "kvm-fold", "--kvm-merge-threshold", "2"], "--kvm-merge-threshold"),
        (
            [
                "niah",
                "--methods",
                "kvm-fold",
                "--kvm-open",
                "8",
                "--kvm-slot-key",
                "centred",
                "--positions",
                "inside",
            ],
            "--kvm-slot-key",
        ),
    ],
)
def test_a_bad_value_is_refused_naming_its_option(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}: " in err, err
    assert "Settings" not in err and "Options" not in err  # no dataclass names


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["niah", "--lengths", "-4096"], "argument --lengths: must be >= 1, got -4096"),
        (["niah", "--depths", "0.5", "2"], "argument --depths: must lie in [0, 1], got 0.5 2.0"),
    ],
)
def test_a_refusal_shows_values_as_the_user_typed_them(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and "(" not in err.splitlines()[-1].split(": ", 2)[-1], err


def test_results_go_to_the_untracked_folder_by_default() -> None:
    assert OUT_DIR != "results" and not (ROOT / OUT_DIR).resolve().is_relative_to(ROOT / "results")
    assert f"{OUT_DIR}/" in (ROOT / ".gitignore").read_text().split()
    defaults = []
    for command in COMMANDS:
        for name, parser in leaf_parsers(command):
            for action in parser._actions:
                if "--out-dir" in action.option_strings:
                    defaults.append((name, action.default))
    assert {name for name, _ in defaults} == {
        "niah", "fold", "drift", "bench kvm", "bench train", "compare-runs", "study", "bounded",
        "eval", "bench document", "bench qa", "bench readme", "bench routing", "bench serve",
        "bench anchor",
    }  # fmt: skip
    assert all(default == OUT_DIR for _, default in defaults), defaults


def test_a_missing_model_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fold", "--model", "/nonexistent/model"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "longkv: error: model '/nonexistent/model': no such folder; pass a model folder, "
        "a GGUF file, a hub id, or one of smollm2, gemma3\n"
    )
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["niah", "--model", "longkv-tests/no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("longkv: error: model 'longkv-tests/no-such-model': not a local")
    assert err.count("\n") == 1
    asked: list[dict[str, Any]] = []

    def unreachable(repo_id: str, **kwargs: Any) -> None:
        asked.append(kwargs)
        raise ConnectionError("no route to host")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    assert main(["niah", "--model", "longkv-tests/no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "the hub cannot be reached: no route to host" in err and err.count("\n") == 1
    assert len(asked) == 1 and asked[0].get("timeout")  # asked once, bounded: no retries


def test_a_model_folder_transformers_cannot_load_is_one_line(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text((Path(tiny_model) / "config.json").read_text())
    assert main(["fold", "--model", str(tmp_path)]) == 2  # a config, no weights
    err = capsys.readouterr().err
    assert err.startswith(f"longkv: error: model '{tmp_path}': ") and err.count("\n") == 1


def test_niah_without_both_fold_and_full_claims_no_agreement(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "niah", "--model", tiny_model, "--tasks", "passkey", "--lengths", "300",
        "--depths", "0.5", "--methods", "streaming", "--budgets", "64", "--stream-chunk", "16",
        "--max-new-tokens", "2", "--out-dir", str(tmp_path), "--name", "n",
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    page = (tmp_path / "n.md").read_text()
    saved = json.loads((tmp_path / "n.json").read_text())
    for text in (printed, page):
        assert "full attention" not in text and "KV-Fold" not in text, text
    assert "fold_equals_full" not in saved
    assert "| passkey | streaming@64 |" in page


def fold_and_full(model: str, out: Path, *extra: str) -> list[str]:
    """`longkv niah` with full attention and the fold (chunks of 64) on one passkey sample,
    writing out/n.*."""
    return [
        "niah", "--model", model, "--tasks", "passkey", "--lengths", "300", "--depths", "0.5",
        "--methods", "full", "fold", "--chunk-size", "64", "--max-new-tokens", "2",
        "--out-dir", str(out), "--name", "n", *extra,
    ]  # fmt: skip


def test_niah_takes_the_answers_another_run_gave_to_its_runs_and_cells(
    tiny_model: str, tmp_path: Path
) -> None:
    """A grid grown by a sample and a method takes the first run's answers and gives the rest."""
    assert main(fold_and_full(tiny_model, tmp_path / "a")) == 0
    first = json.loads((tmp_path / "a" / "n.json").read_text())["records"]
    grown = fold_and_full(tiny_model, tmp_path / "b", "--samples", "2")
    grown[grown.index("fold")] = "streaming"
    extra = ["--budgets", "64", "--stream-chunk", "16"]
    assert main([*grown, *extra, "--niah-records", str(tmp_path / "a" / "n.json")]) == 0
    records = json.loads((tmp_path / "b" / "n.json").read_text())["records"]
    assert sorted((r["method"], r["seed"]) for r in records) == [
        ("full", 0), ("full", 1), ("streaming@64", 0), ("streaming@64", 1),
    ]  # fmt: skip
    assert [r for r in records if r["method"] == "full" and r["seed"] == 0] == [
        r for r in first if r["method"] == "full"
    ]  # taken as given, not answered again
    assert "- 1 needle answers from `longkv niah --model" in (tmp_path / "b" / "n.md").read_text()


def test_niah_answers_again_the_runs_an_option_they_read_changed(
    tiny_model: str, tmp_path: Path
) -> None:
    """The fold at another chunk size answers again; full attention's answer is taken."""
    assert main(fold_and_full(tiny_model, tmp_path / "a")) == 0
    first = json.loads((tmp_path / "a" / "n.json").read_text())["records"]
    other = fold_and_full(
        tiny_model, tmp_path / "b", "--niah-records", str(tmp_path / "a" / "n.json")
    )
    other[other.index("64")] = "32"
    assert main(other) == 0
    records = json.loads((tmp_path / "b" / "n.json").read_text())["records"]
    assert [r for r in records if r["method"] == "full"] == [
        r for r in first if r["method"] == "full"
    ]
    assert [r["method"] for r in records].count("fold") == 1  # answered here, not taken
    assert "- 1 needle answers from `longkv niah --model" in (tmp_path / "b" / "n.md").read_text()


def test_a_fold_variant_is_named_on_the_page_and_refused_where_it_changes_nothing(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(fold_and_full(tiny_model, tmp_path, "--variant", "top-left")) == 0
    assert (
        "KV-Fold in chunks of 64, variant top-left: the causal mask aligned"
        in (tmp_path / "n.md").read_text()
    )
    assert json.loads((tmp_path / "n.json").read_text())["settings"]["variant"] == "top-left"
    argv = ["fold", "--model", tiny_model, "--dtype", "bf16", "--variant", "bf16-cache"]
    assert main(argv) == 2
    assert "error: argument --variant: bf16-cache stores a wider model's cache" in (
        capsys.readouterr().err
    )


def test_bounded_compares_every_bounded_run_on_one_page(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def argv(answer: int, out: Path) -> list[str]:
        return [
            "bounded", "--model", tiny_model, "--nll-tokens", "100", "200", "--tasks", "passkey",
            "--lengths", "300", "--depths", "0.5", "--methods", "full", "streaming", "snapkv",
            "kvm-fold", "--budgets", "64", "128", "--kvm-states", "fixed", "sqrt",
            "--stream-chunk", "16", "--max-new-tokens", str(answer), "--out-dir", str(out),
            "--name", "b",
        ]  # fmt: skip

    runs = [
        "full", "streaming@64", "streaming@128", "snapkv@64", "snapkv@128",
        "kvm-fold/fixed@64", "kvm-fold/sqrt@64", "kvm-fold/fixed@128", "kvm-fold/sqrt@128",
    ]  # fmt: skip
    # an interrupted run left the 100-token NLL behind: it is kept, not measured again
    assert main(argv(1, tmp_path / "x")) == 0
    first = json.loads((tmp_path / "x" / "b.json").read_text())
    settings = {**first["settings"], "max_new_tokens": 2}
    kept = {"100": first["nll"]["100"]}
    save_partial(tmp_path / "b.nll.json", settings, kept)
    # kvm-fold's answers were given by a niah run of the same grid in another process
    niah = [
        "niah", "--model", tiny_model, "--tasks", "passkey", "--lengths", "300", "--depths",
        "0.5", "--methods", "kvm-fold", "--budgets", "64", "128", "--kvm-states", "fixed",
        "sqrt", "--stream-chunk", "16", "--max-new-tokens", "2", "--out-dir",
        str(tmp_path / "x"), "--name", "b_niah",  # not b: the bounded page beside it
    ]  # fmt: skip
    assert main(niah) == 0
    other = tmp_path / "x" / "b_niah.json"
    elsewhere = json.loads(other.read_text())["records"]
    data = json.loads(other.read_text())
    data["settings"]["max_new_tokens"] = 5  # every answer reads it
    (tmp_path / "x" / "c.json").write_text(json.dumps(data))
    assert main([*argv(2, tmp_path), "--niah-records", str(tmp_path / "x" / "c.json")]) == 2
    said = capsys.readouterr().err
    assert "error: argument --methods: " in said and "(['max_new_tokens'] differ)" in said
    # an option only the fold reads changes none of the kvm-fold answers
    data = json.loads(other.read_text())
    data["settings"]["chunk_size"] = 999
    # a grid with a second sample per cell: answers to cells outside this grid are left
    data["settings"]["samples"] = 2
    data["records"] += [{**r, "seed": 1, "prediction": "other"} for r in data["records"]]
    other = tmp_path / "x" / "c.json"
    other.write_text(json.dumps(data))
    twice = ["--niah-records", str(other), str(other)]  # a cell two files answered counts once
    assert main([*argv(2, tmp_path), *twice]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "b.json",
        "b.md",
        "b.png",
        "b_budget.png",
        "b_cost.png",
        "x",
    ]  # the partial files are gone
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["nll"]["100"] == kept["100"]
    assert [r["method"] for r in saved["nll"]["200"]["runs"]] == runs
    assert sorted(r["method"] for r in saved["niah"]["records"]) == sorted(runs)
    assert [r for r in saved["niah"]["records"] if r["method"].startswith("kvm")] == elsewhere
    fates = [r["needle_fate"] for r in saved["niah"]["records"] if r["needle_fate"]]
    assert len(fates) == 4 and all(abs(sum(f[k] for k in FATES) - 1) < 1e-9 for f in fates)
    page = (tmp_path / "b.md").read_text()
    assert "- 4 needle answers from" in page and "- 0 needle answers from" in page
    for text in ("| kvm-fold/sqrt@128 |", "### Peak memory against length", "tokens per founded",
                 "### The cache after the read against length"):  # fmt: skip
        assert text in page
    attends = page.split("## What each bounded run attends")[1].split("##")[0]
    for row in (
        "| streaming@64 | 4 | 60 | - | - | 64 |", "| snapkv@128 | 4 | 64 | 60 kept | - | 68 |",
        "| kvm-fold/sqrt@64 | 4 | 32 | 28 slots | - | 36 |",
    ):  # fmt: skip
        assert row in attends
    cache = page.split("### The cache after the read against length")[1].split("##")[0]
    # a bounded cache holds its budget at 100 and at 200 tokens; full attention twice as much
    assert "| streaming@64 |" in cache and "| 1.00 |" in cache.split("| streaming@64 |")[1]
    assert "| 2.00 |" in cache.split("| full |")[1].split("\n")[0]
    assert "- 4 needle answers from `longkv niah --model" in page
    printed = capsys.readouterr().out  # the NLL, time and memory tables, not only the needles
    assert "200 tokens:" in printed and "| kvm-fold/sqrt@128 | 16 |" in printed


def test_the_fate_table_sizes_founded_slots_only_where_the_answer_founded_some() -> None:
    def record(method: str, score: float, founded: float, size: float) -> NiahRecord:
        fate = {"exact": 0.0, "founded": founded, "merged": 1 - founded, "dropped": 0.0,
                "founded_slot_tokens": size}  # fmt: skip
        return NiahRecord("t", 100, 0.5, 0, method, ["1"], "", [], score, 1.0, fate)

    rows = fate_rows([record("k", 0.0, 0.5, 3.0), record("k", 0.0, 0.0, 0.0)])
    assert rows[2] == "| k | no | 2 | 0.0 % | 25.0 % | 75.0 % | 0.0 % | 3.0 |"
    assert fate_rows([record("k", 1.0, 0.0, 0.0)])[2].endswith("| 0.0 % | - |")


def test_the_cost_plot_puts_each_method_at_its_attended_share_and_nll_gap(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from longkv.bench import bounded

    def run(method: str, share: float, gap: float) -> dict[str, Any]:
        return {"method": method, "attended_share": share, "nll_gap_vs_full": gap}

    nll = {"4096": {"runs": [run("full", 1.0, 0.0), run("two", 0.2, 0.001)]},
           "8192": {"runs": [run("full", 1.0, 0.0), run("two", 0.1, 0.002)]}}  # fmt: skip
    shown: list[Any] = []
    monkeypatch.setattr(bounded, "finish_figure", lambda fig, path, title: shown.append(fig))
    bounded.cost_plot(nll, tmp_path / "c.png", "longkv bounded: m, fp32")
    (fig,) = shown
    _, second = fig.axes
    assert [ax.get_title() for ax in fig.axes] == ["4096 tokens", "8192 tokens"]
    points = {t.get_text(): t.xy for t in second.texts}
    assert points == {"full": (100.0, 0.0), "two": (10.0, 0.002)}


def test_the_route_table_ranks_only_the_samples_whose_answer_left_the_window() -> None:
    def record(score: float, route: dict[str, float]) -> NiahRecord:
        return NiahRecord("t", 100, 0.5, 0, "k/open8", ["1"], "", [], score, 1.0, route)

    rows = route_rows(
        [
            record(0.0, {"left": 1.0, "routed": 0.25, "slot_rank": 30.0}),
            record(0.0, {"left": 0.5, "routed": 0.75, "slot_rank": 3.0}),
            record(0.0, {"left": 0.0}),  # every answer token still in the window
            record(1.0, {"left": 0.0}),
        ]
    )
    assert rows[2:] == [
        "| k/open8 | no | 3 | 50.0 % | 50.0 % | 30 |",
        "| k/open8 | yes | 1 | 0.0 % | - | - |",
    ]


def test_the_miss_table_lists_each_miss_where_full_attention_answered() -> None:
    def record(
        method: str, depth: float, score: float, route: dict[str, float] | None = None
    ) -> NiahRecord:
        return NiahRecord("t", 100, depth, 0, method, ["1"], " 7 ", [], score, 1.0, route)

    route = {"left": 1.0, "routed": 0.5, "slot_rank": 12.0}
    rows = miss_rows(
        [
            record("full", 0.25, 1.0), record("full", 0.75, 0.0),
            record("q@64", 0.25, 0.0, route),  # missed where full answered: listed
            record("q@64", 0.75, 0.0, route),  # full missed it too
            record("k@64", 0.25, 1.0, route),  # answered
            record("s@64", 0.25, 0.0),  # no routes: not a retrieval cache
        ]
    )  # fmt: skip
    assert rows[2:] == ["| q@64 | t | 100 | 0.25 | 0 | '7' | 100.0 % | 50.0 % | 12 |"]


def test_niah_with_fold_and_full_says_whether_they_agree(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(fold_and_full(tiny_model, tmp_path, "--dtype", "fp64")) == 0
    claim = "The fold's answers equal full attention's on every sample."
    assert claim in capsys.readouterr().out and claim in (tmp_path / "n.md").read_text()
    assert json.loads((tmp_path / "n.json").read_text())["fold_equals_full"] is True


def test_niah_runs_two_level_kvm_fold_labelled_and_with_every_slot_open_answers_as_full(
    tiny_model: str, tmp_path: Path
) -> None:
    argv = fold_and_full(tiny_model, tmp_path, "--dtype", "fp64")
    argv[argv.index("fold")] = "kvm-fold"
    two_level = ["--budgets", "64", "--sinks", "4", "--window", "32", "--kvm-open", "0", "28"]
    assert main([*argv, *two_level, "--stream-chunk", "16"]) == 0
    records = json.loads((tmp_path / "n.json").read_text())["records"]
    by_method = {r["method"]: r["prediction"] for r in records}
    assert set(by_method) == {"full", "kvm-fold/fixed@64", "kvm-fold/fixed/open28@64"}
    assert by_method["kvm-fold/fixed/open28@64"] == by_method["full"]  # 28 slots: all open
    fate = next(r["needle_fate"] for r in records if r["method"] == "kvm-fold/fixed/open28@64")
    assert fate["left"] > 0 and fate["routed"] == 1.0  # every slot open: every token routed


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--lengths", "300", "1024"], "--lengths"),  # 1024 - 128 + 31 > 512 positions
        (["--lengths", "300", "40"], "--lengths"),  # 40 tokens cannot hold the task's prompt
        (["--methods", "streaming", "--budgets", "604"], "--budgets"),  # 604 > 512
        # two-level KVM-Fold keeps the positions of full attention
        (
            ["--methods", "kvm-fold", "--kvm-open", "8", "--budgets", "256", "--lengths", "1024"],
            "--lengths",
        ),
    ],
)
def test_niah_checks_the_whole_grid_before_answering(
    tiny_model: str,
    tmp_path: Path,
    answers: list[str],
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    flag: str,
) -> None:
    argv = [
        "niah", "--model", tiny_model, "--tasks", "passkey", "--depths", "0.5",
        "--budgets", "104", "--out-dir", str(tmp_path), *extra,
    ]  # fmt: skip
    assert main(argv) == 2
    assert f"error: argument {flag}: " in capsys.readouterr().err
    assert answers == [] and not list(tmp_path.iterdir())


def test_fold_and_drift_check_positions_before_running(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--model", tiny_model, "--out-dir", str(tmp_path)]
    assert main(["fold", *base, "--tokens", "600"]) == 2
    assert "error: argument --tokens: 600 tokens take 600 positions" in capsys.readouterr().err
    argv = ["fold", *base, "--tokens", "100", "--methods", "streaming", "--budgets", "604"]
    assert main(argv) == 2
    assert "error: argument --budgets: " in capsys.readouterr().err
    # 500 tokens fit, but a BOS before every 64-token chunk adds 8 positions
    argv = ["drift", *base, "--tokens", "510", "--chunk-sizes", "64", "--variants", "bos"]
    assert main(argv) == 2
    assert "error: argument --tokens: 510 tokens and their prefixes take 518" in (
        capsys.readouterr().err
    )
    assert not list(tmp_path.iterdir())


PAST = {  # each takes more than the tiny models' 512 positions
    "fold": ["fold", "--tokens", "600", "--chunk-size", "256", "--dtype", "fp64"],
    "drift": ["drift", "--tokens", "600", "--chunk-sizes", "256", "--dtypes", "fp64",
              "--variants", "exact"],
    "niah": ["niah", "--tasks", "passkey", "--lengths", "700", "--depths", "0.5",
             "--methods", "full", "fold", "--chunk-size", "256", "--max-new-tokens", "2",
             "--dtype", "fp64"],
}  # fmt: skip
PAST_FLAG = {"fold": "--tokens", "drift": "--tokens", "niah": "--lengths"}


@pytest.mark.parametrize("command", sorted(PAST))
def test_a_rope_model_runs_past_its_positions_only_with_allow_extrapolation(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    argv = [*PAST[command], "--model", tiny_model, "--out-dir", str(tmp_path), "--name", "p"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: argument {PAST_FLAG[command]}: " in err, err
    assert "never trained; pass --allow-extrapolation to run anyway" in err, err
    assert not list(tmp_path.iterdir())
    assert main([*argv, "--allow-extrapolation"]) == 0
    saved = json.loads((tmp_path / "p.json").read_text())
    if command == "fold":
        runs = {r["method"]: r for r in saved["runs"]}
        assert runs["fold"]["max_abs_nll_diff_vs_full"] <= 1e-10
    elif command == "drift":
        assert len(saved["runs"][0]["fold_nll"]) == 3  # 600 tokens in chunks of 256
    else:
        assert saved["fold_equals_full"] is True
        assert {r["context_len"] for r in saved["records"]} == {700}


@pytest.mark.parametrize("method", ["kvm-fold", "quest", "infllm"])
def test_a_retrieval_cache_reads_past_the_models_positions_with_positions_inside(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str
) -> None:
    argv = [
        "niah", "--model", tiny_model, "--tasks", "passkey", "--lengths", "700", "--depths",
        "0.5", "--methods", method, "--kvm-open", "2", "--budgets", "104", "--stream-chunk",
        "32", "--max-new-tokens", "2", "--dtype", "fp64", "--out-dir", str(tmp_path),
        "--name", "p",
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: argument --lengths: " in err and "(--positions inside" in err, err
    assert main([*argv, "--positions", "inside"]) == 0
    records = json.loads((tmp_path / "p.json").read_text())["records"]
    assert [r["method"].split("@")[0].endswith("/inside") for r in records] == [True]


def test_streaming_stays_within_the_positions_with_allow_extrapolation(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--model", tiny_model, "--out-dir", str(tmp_path), "--allow-extrapolation"]
    argv = ["fold", *base, "--tokens", "100", "--methods", "streaming", "--budgets", "604"]
    assert main(argv) == 2
    said = capsys.readouterr().err.split("error: argument ")[-1]  # after the usage lines
    assert said.startswith("--budgets: ") and "extrapolation" not in said, said


@pytest.mark.parametrize("command", sorted(PAST))
@pytest.mark.parametrize("allow", [False, True])
def test_a_model_with_learned_positions_never_runs_past_them(
    tiny_gpt2: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    allow: bool,
) -> None:
    argv = [*PAST[command], "--model", tiny_gpt2, "--out-dir", str(tmp_path)]
    assert main(argv + ["--allow-extrapolation"] * allow) == 2
    said = capsys.readouterr().err.split("error: argument ")[-1]  # after the usage lines
    assert said.startswith(f"{PAST_FLAG[command]}: "), said
    assert "positions are not rotary" in said and "extrapolation" not in said, said
    assert not list(tmp_path.iterdir())


# readings of other pages, no command of their own
WRITTEN_PAGES = {"study_verdicts.md", "kvfold_verdicts.md"}


def test_results_readme_names_each_page_with_its_command_and_commit() -> None:
    readme = (ROOT / "results" / "README.md").read_text().splitlines()
    pages = sorted(p for p in (ROOT / "results").glob("*.md") if p.name != "README.md")
    assert pages
    for page in pages:
        row = next((r for r in readme if r.startswith(f"| [{page.name}]")), None)
        assert row is not None, f"results/README.md does not list {page.name}"
        if page.name in WRITTEN_PAGES:
            continue
        head = page.read_text().splitlines()[:6]
        command = next(line for line in head if line.startswith("- command: `longkv "))
        commit = next(line for line in head if line.startswith("- commit: `"))
        # the command that made the page, told to write here again (if it did not already)
        made = command.split("`")[1]
        here = made if " --out-dir results " in f"{made} " else f"{made} --out-dir results"
        assert f"`{here}`" in row, row
        assert f"`{commit.split('`')[1][:7]}" in row, row


GRID = ("chunk_sizes", "dtypes", "variants", "name")  # what a drift rerun may change


def test_an_interrupted_drift_grid_resumes_and_a_grown_one_runs_only_what_is_new(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measure = drift_grid.measure_drift
    calls: list[tuple[int, str]] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append((args[2], kwargs["variant"]))
        if len(calls) == 2 and interrupt:
            raise KeyboardInterrupt
        return measure(*args, **kwargs)

    monkeypatch.setattr(drift_grid, "measure_drift", counted)
    base = ["drift", "--model", tiny_model, "--out-dir", str(tmp_path), "--name", "d",
            "--tokens", "96", "--chunk-sizes", "16", "32", "--dtypes", "fp64"]  # fmt: skip
    interrupt = True
    assert main([*base, "--variants", "exact"]) == 130  # one line, the folds so far kept
    assert calls == [(16, "exact"), (32, "exact")]
    assert [p.name for p in tmp_path.iterdir()] == ["d.runs.json"]  # the first fold is kept
    interrupt = False
    assert main([*base, "--variants", "exact", "restart"]) == 0
    # only what the partial file lacks runs, and the page lists the grid in its own order
    assert calls[2:] == [(32, "exact"), (16, "restart"), (32, "restart")]
    saved = json.loads((tmp_path / "d.json").read_text())
    assert [(r["chunk_size"], r["variant"]) for r in saved["runs"]] == [
        (16, "exact"), (32, "exact"), (16, "restart"), (32, "restart")
    ]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.json", "d.md", "d.png"]
    # a partial file is reused with the page's own settings, and not with other ones
    settings = {k: v for k, v in saved["settings"].items() if k not in GRID}
    for tokens, runs in ((96, [(32, "exact")]), (128, [(16, "exact"), (32, "exact")])):
        parts = {"fp64/16/exact": saved["runs"][0]}
        save_partial(tmp_path / "d.runs.json", {**settings, "tokens": tokens}, parts)
        del calls[:]
        assert main([*base, "--variants", "exact"]) == 0
        assert calls == runs


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["niah"], "nothing kept; rerun: longkv niah"),  # interrupted before an answer
        (["bounded"], "(.nll.json, .niah.json); resume with: longkv bounded"),
        (["drift"], "the finished folds are beside the page (.runs.json); resume with: longkv"),
        (["fold"], "nothing kept; rerun: longkv fold"),
        (["bench", "kvm"], "nothing kept; rerun: longkv bench kvm"),
        (["bench", "train"], "nothing kept; rerun: longkv bench train"),
        (
            ["eval-loss", "--config", "r.yaml"],
            "nothing kept; rerun: longkv eval-loss --config r.yaml",
        ),
    ],
)
def test_ctrl_c_in_a_command_prints_one_line_with_what_was_kept_and_the_command(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    said: str,
) -> None:
    def interrupted(args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("longkv.cli.main.build_settings", interrupted)  # Ctrl-C as it starts
    assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"longkv {argv[0]}: interrupted; "), err
    assert said in err[0]


def test_ctrl_c_while_a_command_loads_prints_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(name: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("longkv.cli.main.importlib.import_module", interrupted)  # torch loading
    assert main(["ask", "--question", "Q"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["longkv ask: interrupted; nothing kept; rerun: longkv ask --question Q"]


def test_kept_help_is_what_the_parsers_render_and_prints_without_torch() -> None:
    """`longkv CMD --help` prints the kept text (cli/help.json), the same as the parsers
    render, without importing torch; run `python -m longkv.cli.helptext` after changing an
    option."""
    from longkv.cli.helptext import HELP_FILE, rendered

    kept = json.loads(HELP_FILE.read_text(encoding="utf-8"))
    live = rendered()
    changed = sorted(k for k in {*kept, *live} if kept.get(k) != live.get(k))
    assert not changed, f"{changed}: run python -m longkv.cli.helptext"
    code = (
        "import sys\nfrom longkv.cli.main import main\nmain(['bench', 'routing', '-h'])\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.startswith("usage: longkv bench routing [-h]"), run.stdout[:200]
    assert run.stdout.rstrip().endswith("False False")


def ask_argv(model: str, doc: Path, *extra: str) -> list[str]:
    return [
        "ask", "--model", model, "--file", str(doc), "--question", "What is the word?",
        "--max-new-tokens", "6", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "how",
    [
        ["--method", "fold", "--chunk-size", "64"],
        ["--method", "kvm-fold", "--budgets", "64", "--window", "32", "--stream-chunk", "16"],
        [
            "--method",
            "kvm-fold",
            "--budgets",
            "64",
            "--window",
            "32",
            "--kvm-open",
            "4",
            "--stream-chunk",
            "16",
        ],
    ],
)
def test_ask_answers_a_document_as_its_method_decodes_it(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], how: list[str]
) -> None:
    """The printed answer is the greedy answer of the method read the same prompt: the
    document, then the question (GPT-2's tokenizer has no chat template)."""
    from longkv.caches.methods import make_runner, read_and_answer
    from longkv.cli.ask import AskOptions
    from longkv.document.prompt import prompt_ids
    from longkv.models.pretrained import load_pretrained

    doc = tmp_path / "doc.txt"
    doc.write_text("The word is heliotrope. " * 30)
    assert main(ask_argv(tiny_model, doc, *how)) == 0
    printed = capsys.readouterr().out
    model, tokenizer = load_pretrained(tiny_model, torch.float32)
    ids = prompt_ids(tokenizer, doc.read_text(), "What is the word?")
    assert tokenizer.decode(ids).endswith("heliotrope. \n\nQuestion: What is the word?\nAnswer:")
    flags = {a.lstrip("-").replace("-", "_"): a for a in how if a.startswith("--")}
    values = dict(zip(flags, [how[how.index(f) + 1] for f in flags.values()], strict=True))
    o = AskOptions(
        file=str(doc), question=("q",), method=values["method"],
        chunk_size=int(values.get("chunk_size", 1024)),
        budgets=(int(values.get("budgets", 1024)),),
        window=int(values["window"]) if "window" in values else None,
        stream_chunk=int(values.get("stream_chunk", 64)),
        kvm_open=(int(values.get("kvm_open", 0)),),
    )  # fmt: skip
    configs = o.bounded_configs((o.method,))
    runner = make_runner(model, next(iter(configs.values()))) if configs else None
    eos = tokenizer.eos_token_id
    out = read_and_answer(
        model, torch.tensor([ids]), o.method, 6, runner=runner, chunk_size=o.chunk_size,
        stream_chunk=o.stream_chunk, eos_token_id=eos,
    )[0].tolist()  # fmt: skip
    answer = out[: out.index(eos)] if eos in out else out
    assert printed == tokenizer.decode(answer, skip_special_tokens=True) + "\n"


def test_ask_reads_stdin_and_uses_a_chat_template_when_the_tokenizer_has_one(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import io

    from longkv.document.prompt import document_ids, prompt_ids
    from longkv.models.pretrained import load_pretrained

    _, tokenizer = load_pretrained(tiny_model, torch.float32)
    tokenizer.chat_template = "{% for m in messages %}<user>{{ m['content'] }}{% endfor %}<bot>"
    ids = prompt_ids(tokenizer, "a doc", "a question?")
    assert tokenizer.decode(ids) == "<user>a doc\n\na question?<bot>"
    assert (
        prompt_ids(tokenizer, "a doc", "q?", chat=False)
        == tokenizer("a doc\n\nQuestion: q?\nAnswer:")["input_ids"]
    )
    monkeypatch.setattr("sys.stdin", io.StringIO("The word is moss."))
    assert main(ask_argv(tiny_model, Path("-"), "--method", "full")) == 0
    read = len(document_ids(tokenizer, "The word is moss.", chat=False))
    # stdin, no template: the document's part of the prompt, before the question's
    assert f"{read} tokens read by full in " in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--method", "full"], "argument --method: "),  # 600 words > 512 positions
        (["--method", "full"], "pass --allow-extrapolation"),
        (["--method", "fold"], "(--method auto, the default, picks one) or ask for fewer --max"),
        (
            [
                "--method",
                "kvm-fold",
                "--budgets",
                "64",
                "--kvm-open",
                "4",
                "--window",
                "32",
                "--stream-chunk",
                "16",
            ],
            "argument --method: ",
        ),
        (
            [
                "--method",
                "kvm-fold",
                "--budgets",
                "64",
                "--kvm-open",
                "4",
                "--window",
                "32",
                "--stream-chunk",
                "16",
            ],
            "(streaming, snapkv, kvm-fold without --kvm-open / open=0)",
        ),
        (["--sample", "--top-p", "0"], "argument --top-p: must lie in (0, 1]"),
    ],
)
def test_ask_refuses_before_reading_what_it_cannot_read(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
    said: str,
) -> None:  # fmt: skip
    doc = tmp_path / "doc.txt"
    doc.write_text("word " * 600)
    assert main(ask_argv(tiny_model, doc, *extra)) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err


def test_ask_takes_one_value_under_a_singular_name_the_plural_still_accepted(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text("word " * 100)
    with pytest.raises(SystemExit):
        main(ask_argv(tiny_model, doc, "--method", "streaming", "--budget", "64", "128"))
    assert "unrecognized arguments: 128" in capsys.readouterr().err
    for flag in ("--budget", "--budgets"):
        argv = ask_argv(
            tiny_model, doc, "--method", "streaming", flag, "64", "--stream-chunk", "16"
        )
        assert main(argv) == 0
        assert "tokens read by streaming@64 in " in capsys.readouterr().err


def test_bounded_puts_two_level_runs_on_the_page_with_their_leaves_and_routes(
    tiny_model: str, tmp_path: Path
) -> None:
    """The page the two-level study uses: coarse and two-level runs side by side, int8 leaves
    for one of them alone (--only), the leaves' bytes, the entries attended and the routes."""
    argv = [
        "bounded", "--model", tiny_model, "--nll-tokens", "150", "300", "--tasks", "passkey",
        "--lengths", "300", "--depths", "0.5", "--methods", "full", "kvm-fold", "--budgets",
        "64", "--window", "32", "--stream-chunk", "16", "--kvm-open", "0", "8", "--leaf-budget",
        "64", "--kvm-leaves", "exact", "int8", "--only", "full", "kvm-fold/fixed@64",
        "kvm-fold/fixed/open8@64", "kvm-fold/fixed/open8/int8@64", "--max-new-tokens", "2",
        "--out-dir", str(tmp_path), "--name", "b",
    ]  # fmt: skip
    assert main(argv) == 0
    saved = json.loads((tmp_path / "b.json").read_text())
    runs = {r["method"]: r for r in saved["nll"]["300"]["runs"]}
    assert list(runs) == [
        "full", "kvm-fold/fixed@64", "kvm-fold/fixed/open8@64", "kvm-fold/fixed/open8/int8@64"
    ]  # fmt: skip
    exact, int8 = runs["kvm-fold/fixed/open8@64"], runs["kvm-fold/fixed/open8/int8@64"]
    assert 0 < int8["leaf_bytes"] < exact["leaf_bytes"] and runs["full"]["leaf_bytes"] == 0
    assert exact["cache_bytes"] == int8["cache_bytes"]  # the same bounded part
    assert exact["attended_share"] < 1 and runs["full"]["attended_share"] == 1
    page = (tmp_path / "b.md").read_text()
    assert "## How the retrieval caches routed to the needles' answer tokens" in page
    assert "| kvm-fold/fixed/open8/int8@64 |" in page.split("routed to the needles")[1]


def test_bounded_measures_the_fold_when_asked_for_it(tiny_model: str, tmp_path: Path) -> None:
    argv = [
        "bounded", "--model", tiny_model, "--dtype", "fp64", "--nll-tokens", "150", "--tasks",
        "passkey", "--lengths", "300", "--depths", "0.5", "--methods", "full", "fold",
        "streaming", "--chunk-size", "32", "--budgets", "64", "--stream-chunk", "16",
        "--max-new-tokens", "2", "--out-dir", str(tmp_path), "--name", "b",
    ]  # fmt: skip
    assert main(argv) == 0
    runs = {
        r["method"]: r for r in json.loads((tmp_path / "b.json").read_text())["nll"]["150"]["runs"]
    }
    assert list(runs) == ["full", "fold", "streaming@64"]
    assert runs["fold"]["chunk_size"] == 32
    assert runs["fold"]["max_abs_nll_diff_vs_full"] <= 1e-10
    assert runs["streaming@64"]["max_abs_nll_diff_vs_full"] > 1e-3


def test_exact_up_to_keeps_full_attention_to_the_lengths_it_can_read(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Full attention and the fold answer up to --exact-up-to, past the model's 512 positions
    only the bounded caches do (no --allow-extrapolation needed); on the bounded page full
    attention is the NLL reference where it ran, and past it the caches are measured alone."""
    grid = [
        "--model", tiny_model, "--tasks", "passkey", "--lengths", "300", "800", "--depths",
        "0.5", "--methods", "full", "fold", "streaming", "--chunk-size", "64", "--budgets", "64",
        "--stream-chunk", "16", "--max-new-tokens", "2", "--out-dir", str(tmp_path),
    ]  # fmt: skip
    assert main(["niah", *grid, "--name", "n"]) == 2  # full attention past 512 positions
    assert "--allow-extrapolation" in capsys.readouterr().err
    assert main(["niah", *grid, "--exact-up-to", "512", "--name", "n"]) == 0
    saved = json.loads((tmp_path / "n.json").read_text())
    keys = {(r["method"], r["context_len"]) for r in saved["records"]}
    assert keys == {("full", 300), ("fold", 300), ("streaming@64", 300), ("streaming@64", 800)}
    page = (tmp_path / "n.md").read_text()
    assert "KV-Fold in chunks of 64 (up to 512 tokens)" in page
    assert "| passkey | full |" in page and "The fold's answers equal full attention's" in page
    # a bounded page reuses those answers; its NLL past 512 tokens has no full attention
    bounded = ["bounded", *grid, "--exact-up-to", "512", "--name", "b", "--niah-records",
               str(tmp_path / "n.json")]  # fmt: skip
    assert main([*bounded, "--nll-tokens", "600", "700"]) == 2
    assert "--exact-up-to 512 tokens: give at least one length within it" in (
        capsys.readouterr().err
    )
    assert main([*bounded, "--nll-tokens", "200", "700"]) == 0
    nll = json.loads((tmp_path / "b.json").read_text())["nll"]
    assert [r["method"] for r in nll["200"]["runs"]] == ["full", "fold", "streaming@64"]
    assert [r["method"] for r in nll["700"]["runs"]] == ["streaming@64"]
    assert nll["700"]["runs"][0]["nll_gap_vs_full"] is None and not nll["700"]["ratios"]
    assert nll["200"]["runs"][1]["max_abs_nll_diff_vs_full"] < 1e-4
    page = (tmp_path / "b.md").read_text()
    assert "4 needle answers from `longkv niah" in page
    peak = page.split("### Peak memory against length")[1]
    assert re.search(r"\| full \| [\d.]+ \| - \| n/a \|", peak)
    assert re.search(r"\| streaming@64 \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", peak)
    per_1k = page.split("### Time per 1K tokens against length")[1].split("###")[0]
    assert "| method | seconds per 1K at 200 | seconds per 1K at 700 | 700 / 200 |" in per_1k
    seconds = {n: r["seconds"] for n in nll for r in nll[n]["runs"] if r["method"] == "full"}
    assert f"| full | {seconds['200'] * 1024 / 200:.2f} | - | n/a |" in per_1k


def interrupted_after(answer: Any, n: int) -> Any:
    """niah_run.answer that gives n answers, then stops as Ctrl-C does."""
    calls: list[int] = []

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) > n:
            raise KeyboardInterrupt
        return answer(*args, **kwargs)

    return interrupted


def test_an_interrupted_niah_says_what_it_saved_and_the_resumed_run_what_it_reused(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    argv = [
        "niah", "--model", tiny_model, "--lengths", "256", "--depths", "0.5", "--methods",
        "full", "fold", "--max-new-tokens", "2", "--out-dir", str(tmp_path),
    ]  # fmt: skip
    answer = niah_run.answer
    monkeypatch.setattr(niah_run, "answer", interrupted_after(answer, 1))
    assert main(argv) == 130
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == (
        f"longkv niah: interrupted; 1 answer saved in {tmp_path / 'niah_demo.answers.json'}; "
        f"resume with: longkv {' '.join(argv)}"
    )
    monkeypatch.setattr(niah_run, "answer", answer)
    assert main(argv) == 0
    assert "niah, 1 of 2 answers reused: " in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "niah_demo.json", "niah_demo.md", "niah_demo.png",
    ]  # fmt: skip


def test_a_niah_run_never_replaces_another_runs_page(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A run of other settings refuses the name of a page it would replace; an interrupted run
    leaves the last whole run's page (json, md, png) as it was."""
    argv = [
        "niah", "--model", tiny_model, "--lengths", "256", "--depths", "0.5", "--methods",
        "full", "fold", "--max-new-tokens", "2", "--out-dir", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0
    page = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    other = [*argv[:-5], "--methods", "fold", *argv[-4:]]
    assert main(other) == 2
    err = capsys.readouterr().err
    assert "argument --name: " in err and "holds a run of other settings (methods differ)" in err
    assert main([*other, "--name", "fold_run"]) == 0
    capsys.readouterr()
    answer = niah_run.answer
    monkeypatch.setattr(niah_run, "answer", interrupted_after(answer, 1))
    assert main(argv) == 130  # the same settings again, interrupted after one answer
    assert {name: (tmp_path / name).read_bytes() for name in page} == page


def test_niah_prints_what_its_scores_are_before_the_table(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "niah", "--model", tiny_model, "--lengths", "256", "--depths", "0.25", "0.75",
        "--methods", "full", "--max-new-tokens", "2", "--out-dir", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    caption = "string_match_all (0-100: the share of a sample's answers found in the reply)"
    assert caption in out and "the mean over depths 0.25, 0.75:" in out
    assert out.index(caption) < out.index("| task | method |")
    assert caption in (tmp_path / "niah_demo.md").read_text()


def test_fold_and_bounded_never_replace_another_runs_page(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fold = ["fold", "--model", tiny_model, "--tokens", "64", "--chunk-size", "32",
            "--out-dir", str(tmp_path)]  # fmt: skip
    assert main(fold) == 0
    page = (tmp_path / "fold_64.json").read_text()
    assert main([*fold, "--chunk-size", "16"]) == 2
    err = capsys.readouterr().err
    assert "argument --name: " in err and "fold_64.json holds a run of other settings" in err
    assert "(chunk_size differ)" in err and (tmp_path / "fold_64.json").read_text() == page
    (tmp_path / "bounded.json").write_text(json.dumps({"settings": {"model": "other"}}))
    bounded = ["bounded", "--model", tiny_model, "--out-dir", str(tmp_path)]
    assert main(bounded) == 2
    assert "bounded.json holds a run of other settings" in capsys.readouterr().err


def test_drift_grows_its_grid_but_never_replaces_another_runs_page(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["drift", "--model", tiny_model, "--tokens", "64", "--out-dir", str(tmp_path)]
    page = {"settings": {"tokens": 64, "text": "other.txt", "chunk_sizes": [8]}}
    (tmp_path / "drift_64.json").write_text(json.dumps(page))
    assert main([*base, "--chunk-sizes", "16"]) == 2
    err = capsys.readouterr().err
    assert "argument --name: " in err and "drift_64.json holds a run of other settings" in err
    assert "chunk_sizes" not in err.splitlines()[-1]  # a grid may grow: not a difference
