"""`longkv ask` with several questions, JSON lines and a saved read (`longkv read --save`,
`ask --load`); a fold read's cache packed in the dtype asked; documents that are not text
refused naming --file; `import longkv` alone lets transformers' Auto classes load a saved
longkv model.

The model commands run on a tiny random Llama saved with the shared GPT-2 tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import over_tokenizer, saved_model, tiny_hf_config, tiny_longkv
from longkv.cli.main import main
from longkv.document.save import load
from longkv.fold.packed import PackedLayer
from longkv.train.tokenizer import gpt2_tokenizer

QUESTIONS = ["What is the word?", "Which word?", "Say the word."]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder with a 1-layer random Llama (2048 positions) and the GPT-2 tokenizer."""
    config = tiny_hf_config(**over_tokenizer(gpt2_tokenizer()), max_position_embeddings=2048)
    return saved_model(tmp_path_factory, "tiny", config, LlamaForCausalLM)


@pytest.fixture
def document(tmp_path: Path) -> Path:
    doc = tmp_path / "doc.txt"
    doc.write_text("The word is heliotrope. It was said twice. " * 40)
    return doc


METHOD = ["--method", "kvm-fold", "--budgets", "64", "--kvm-open", "4", "--stream-chunk", "16"]


def asked(*argv: str) -> list[str]:
    return [a for q in QUESTIONS for a in ("--question", q)] + list(argv)


def test_ask_answers_each_question_from_one_read_as_json_lines(
    tiny_model: str, document: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["ask", "--model", tiny_model, "--file", str(document), "--max-new-tokens", "5"]
    assert main([*base, *asked(*METHOD)]) == 0
    out, err = capsys.readouterr()
    assert err.count("tokens read by kvm-fold/fixed/open4@64 in ") == 1  # one read
    assert [line.split(": ", 1)[1] for line in err.splitlines() if "question " in line] == QUESTIONS
    text_answers = out.splitlines()
    assert main([*base, *asked(*METHOD, "--json")]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["question"] for d in lines] == QUESTIONS
    assert [d["answer"] for d in lines] == text_answers
    assert all(
        d["seconds"] >= d["first_token_seconds"] > 0 and 1 <= d["tokens"] <= 5 for d in lines
    )


def test_a_read_saved_by_longkv_read_answers_as_the_read_itself(
    tiny_model: str, document: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--model", tiny_model, "--file", str(document)]
    assert main(["ask", *base, *asked(*METHOD, "--json", "--max-new-tokens", "5")]) == 0
    direct = capsys.readouterr().out
    save = tmp_path / "read"
    assert main(["read", *base, *METHOD, "--save", str(save)]) == 0
    assert f"saved to {save} in " in capsys.readouterr().err
    assert main(["ask", "--load", str(save), *asked("--json", "--max-new-tokens", "5")]) == 0
    out, err = capsys.readouterr()
    assert "tokens read by kvm-fold/fixed/open4@64, loaded" in err
    kept = [
        [{k: v for k, v in json.loads(line).items() if "seconds" not in k} for line in lines]
        for lines in (direct.splitlines(), out.splitlines())
    ]
    assert len(kept[0]) == len(QUESTIONS) and kept[0] == kept[1]
    (save / "tensors.pt").write_bytes(b"")
    assert main(["ask", "--load", str(save), "--question", "Q?"]) == 2
    err = capsys.readouterr().err
    assert "tensors.pt is truncated or changed (0 bytes" in err and len(err.splitlines()) == 1


def test_a_fold_read_keeps_its_cache_packed_in_the_cache_dtype_asked(
    tiny_model: str, document: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["ask", "--model", tiny_model, "--file", str(document), "--method", "fold"]
    answers = []
    for extra in ([], ["--cache-dtype", "fp32"]):  # packed in float32: the same numbers
        assert main([*base, *extra, *asked("--json", "--max-new-tokens", "5")]) == 0
        lines = capsys.readouterr().out.splitlines()
        answers.append([json.loads(line)["answer"] for line in lines])
    assert len(answers[0]) == len(QUESTIONS) and answers[0] == answers[1]
    save = tmp_path / "read"
    argv = ["read", "--model", tiny_model, "--file", str(document), "--method", "fold"]
    assert main([*argv, "--cache-dtype", "fp16", "--save", str(save)]) == 0
    doc = load(save)
    assert doc.settings.cache_dtype == "fp16"
    assert all(
        isinstance(layer, PackedLayer) and layer.store_dtype == torch.float16
        for layer in doc.runner.cache.layers
    )


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"", "doc.bin is empty: there is nothing to read"),
        (b"  \n\n", "doc.bin is empty: there is nothing to read"),
        (b"GIF89a\x01\x00\xf0\x9f\x00\xff", "doc.bin is not text (not UTF-8: byte 0xf0 at 8)"),
        (b"text\x00with NUL", "doc.bin holds NUL characters: it is not text"),
    ],
)
def test_a_document_that_is_not_text_is_refused_naming_file(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, said: str
) -> None:
    doc = tmp_path / "doc.bin"
    doc.write_bytes(content)
    argv = ["ask", "--model", tiny_model, "--file", str(doc), "--question", "Q?"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"argument --file: {doc}" in err and said in err, err


def test_ask_needs_a_document_or_a_saved_read_and_nonempty_questions(
    tiny_model: str, document: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ask", "--model", tiny_model, "--question", "Q?"]) == 2
    assert "argument --file: give the document (--file) or a saved read" in capsys.readouterr().err
    assert main(["ask", "--model", tiny_model, "--file", str(document), "--question", " "]) == 2
    assert "argument --question: is empty" in capsys.readouterr().err


LOAD = "print(type(AutoModelForCausalLM.from_pretrained(sys.argv[1])).__name__)"


def test_import_longkv_alone_lets_auto_classes_load_a_saved_longkv_model(tmp_path: Path) -> None:
    """Before transformers' Auto classes are imported, or after; without it, transformers asks
    for remote code (so the test can tell)."""
    tiny_longkv(["kvm"]).save_pretrained(tmp_path)
    imports = {
        "longkv first": "import longkv\nfrom transformers import AutoModelForCausalLM",
        "auto first": "from transformers import AutoModelForCausalLM\nimport longkv",
        "no longkv": "from transformers import AutoModelForCausalLM",
    }
    heavy = "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    alone = subprocess.run(
        [sys.executable, "-c", f"import sys, longkv; {heavy}"], capture_output=True, text=True
    )
    assert alone.stdout.strip() == "[]", alone.stderr  # import longkv alone imports neither
    for case, lines in imports.items():
        script = f"{lines}\nimport sys\n" + LOAD
        run = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True
        )
        if case == "no longkv":
            assert run.returncode != 0 and "trust_remote_code" in run.stderr, run.stderr
        else:
            assert run.stdout.strip() == "LongKVForCausalLM", (case, run.stderr)


def test_ask_and_read_offer_only_the_options_of_one_method_run() -> None:
    from longkv.cli.main import build_parser

    for command in ("ask", "read"):
        parser = build_parser(command)._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
        text = " ".join(parser.format_help().split())
        assert "--only" not in text and "BUDGET [" not in text and "KVM_OPEN [" not in text
        assert "--budget BUDGET, --budgets BUDGET" in text and "--kvm-state KVM_STATE," in text
        groups = [g.title for g in parser._action_groups if g._group_actions]
        assert groups[1] == "the document and the questions"  # after -h's
        assert groups.index("how the document is read (see below)") < groups.index("the model")
        assert groups[-1] == "infllm options (expert)"


def test_two_level_reads_as_the_default_setting_and_options_given_change_it(
    tiny_model: str, document: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import dataclasses

    from longkv.caches.kvm_fold import TWO_LEVEL
    from longkv.cli.ask import AskOptions
    from longkv.document.read import read_settings

    def config(**given: object) -> object:
        options = AskOptions(file="doc.txt", question=("q",), method="two-level", **given)
        options = options.chosen(None, 0, frozenset(given))
        assert options.method == "kvm-fold"
        ((c,),) = [tuple(options.bounded_configs(("kvm-fold",)).values())]
        return c

    assert config() == TWO_LEVEL == read_settings("two-level").config
    assert TWO_LEVEL.budget == 2048 and TWO_LEVEL.window == 1020 and TWO_LEVEL.middle_len == 1024
    assert config(kvm_leaves=("file",)) == dataclasses.replace(TWO_LEVEL, leaves="file")
    assert config(budgets=(4096,), kvm_open=(8,)) == dataclasses.replace(
        TWO_LEVEL, budget=4096, open=8
    )
    # given at kvm-fold's own default, an option still sets its part
    assert config(routing="block") == dataclasses.replace(TWO_LEVEL, routing="block")
    # kvm-fold itself keeps the coarse defaults
    plain = AskOptions(file="doc.txt", question=("q",), method="kvm-fold")
    assert list(plain.bounded_configs(("kvm-fold",))) == ["kvm-fold/fixed@1024"]
    ask = ["ask", "--model", tiny_model, "--file", str(document), "--max-new-tokens", "2"]
    assert main([*ask, "--method", "two-level", "--question", "Which word?"]) == 0
    assert (
        "tokens read by kvm-fold/fixed/cap1/open1024/rerank4096/token@2048 in "
        in capsys.readouterr().err
    )


def test_auto_reads_by_the_fold_while_it_fits_and_by_infllm_past_the_models_positions(
    tiny_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default method: the exact fold while the document, question and answer fit the
    model's 2048 positions, InfLLM with its positions inside past them; one line says which,
    and the options given set the chosen method."""
    short, long = tmp_path / "short.txt", tmp_path / "long.txt"
    short.write_text("The word is heliotrope. " * 20)  # 161 tokens
    long.write_text("The word is heliotrope. " * 300)  # 2401 tokens
    ask = ["ask", "--model", tiny_model, "--question", "Q?", "--max-new-tokens", "2"]
    small = ["--budgets", "128", "--stream-chunk", "64"]
    assert main([*ask, "--file", str(short), *small]) == 0
    err = capsys.readouterr().err
    assert "read by the exact fold: the 171 positions to read fit the model's 2048\n" in err
    assert "161 tokens read by fold in " in err
    assert main([*ask, "--file", str(long), *small]) == 0
    err = capsys.readouterr().err
    said = "read by infllm with positions inside its budget: the 2411 positions to read pass"
    assert said in err and "2401 tokens read by infllm/inside@128 in " in err, err


def test_a_read_past_the_models_positions_is_refused_before_its_weights_load(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The tokenizer and config tell the length; the refusal names --method and the options
    that fix it (auto, fewer answer tokens), and no weights are loaded for it."""
    from longkv.cli.common import LoadOptions

    def never(*args: object) -> None:
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(LoadOptions, "load_weights", never)
    doc = tmp_path / "doc.txt"
    doc.write_text("The word is heliotrope. " * 20)  # 161 tokens
    ask = ["ask", "--model", tiny_model, "--file", str(doc), "--question", "Q?"]
    assert main([*ask, "--method", "fold", "--max-new-tokens", "4000"]) == 2
    err = capsys.readouterr().err
    assert "argument --method: the document, question and answer under fold take 4169 " in err
    assert "max_position_embeddings = 2048" in err and "--method auto, the default" in err
    assert "ask for fewer --max-new-tokens" in err and "--file" not in err.split("error:")[1]


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--method", "streaming", "--kvm-open", "8"], "argument --kvm-open: is read by kvm-fold "
         "only, and streaming ignores it: drop it, or pass --method kvm-fold"),
        (["--method", "fold", "--budget", "64"], "argument --budget: is read by streaming, "),
        (["--method", "infllm", "--quest-page", "8"], "argument --quest-page: is read by quest"),
        (["--method", "streaming", "--chunk-size", "64"], "argument --chunk-size: is read by fold"),
        (["--method", "streaming", "--cache-dtype", "fp16"],
         "argument --cache-dtype: is read by full, fold only"),
    ],
)  # fmt: skip
def test_an_option_the_named_method_ignores_is_refused(
    tiny_model: str, document: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
    said: str,
) -> None:  # fmt: skip
    argv = ["ask", "--model", tiny_model, "--file", str(document), "--question", "Q?", *extra]
    assert main(argv) == 2
    assert said in capsys.readouterr().err


def test_an_option_a_saved_read_keeps_is_refused_with_load(
    tiny_model: str, document: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save = tmp_path / "read"
    assert main(["read", "--model", tiny_model, "--file", str(document), "--save", str(save)]) == 0
    ask = ["ask", "--load", str(save), "--question", "Q?", "--max-new-tokens", "2"]
    for extra, flag in ((["--model", tiny_model], "--model"), (["--method", "fold"], "--method")):
        assert main([*ask, *extra]) == 2
        assert f"argument {flag}: is the saved read's (--load)" in capsys.readouterr().err
    assert main([*ask, "--device", "cpu", "--json"]) == 0


def test_a_refusal_fed_through_an_option_is_reported_under_its_shown_name() -> None:
    """A config's refusal of a field an option feeds names the option as --help shows it
    (`--budget`), not its plural alias."""
    from longkv.caches.bounded import BoundedConfig
    from longkv.caches.kvm_fold import KVMFoldConfig
    from longkv.checks import SettingError
    from longkv.cli.args import declared
    from longkv.cli.main import build_parser

    parser = build_parser("ask")._subparsers._group_actions[0].choices["ask"]  # type: ignore[union-attr]
    spec = declared(parser)
    assert spec.flag_of(SettingError(BoundedConfig, "budget", "x")) == "--budget"
    assert spec.flag_of(SettingError(KVMFoldConfig, "state", "x")) == "--kvm-state"
    assert spec.flag_of(SettingError(KVMFoldConfig, "leaves", "x")) == "--kvm-leaf-store"
