"""`longkv niah`: the needle-in-a-haystack grid (`longkv.evals.niah_run`) answered by full
attention, KV-Fold and the bounded caches (StreamingLLM, SnapKV, KVM-Fold), and its page: the
accuracy table, whether the fold answered as full attention did, and the heatmap
(`longkv.evals.niah_report`)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from longkv.checks import setting
from longkv.cli.args import command
from longkv.cli.common import (
    ModelOptions,
    dtype_setting,
    niah_records_setting,
    require_own_page,
)
from longkv.evals.niah_records import NiahSettings
from longkv.evals.niah_report import (
    accuracy_caption,
    accuracy_table,
    verdict,
    write_niah_page,
)
from longkv.evals.niah_resume import reused_answers, saved_records, saved_settings
from longkv.evals.niah_run import run_niah
from longkv.results import provenance


@dataclass(frozen=True)
class NiahOptions:
    """`longkv niah`'s options beside the grid: the model's dtype and the results' name."""

    dtype: str = dtype_setting()
    name: str = setting("niah_demo", "file name stem of the results")
    niah_records: tuple[str, ...] = niah_records_setting()


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of `niah`; its defaults are the short demonstration `make run` shows."""
    command(
        parser, run, ModelOptions, NiahOptions, NiahSettings,
        kept=saved_answers,
    )  # fmt: skip


def answers_path(m: ModelOptions, o: NiahOptions) -> Path:
    """Where a run keeps its answers as it gives them, beside its page (removed once the page
    is written): an interrupted run resumes from it, and the page's files stay the last whole
    run's until this one ends."""
    return Path(m.out_dir) / f"{o.name}.answers.json"


def saved_answers(args: argparse.Namespace) -> str | None:
    """How many answers of this grid the run has kept (None: none)."""
    path = answers_path(args.settings[ModelOptions], args.settings[NiahOptions])
    n = len(saved_records(path, args.settings[NiahSettings]))
    return f"{n} answer{'s' if n > 1 else ''} saved in {path}" if n else None


def run(args: argparse.Namespace, argv: list[str]) -> int:
    m, o = args.settings[ModelOptions], args.settings[NiahOptions]
    settings = args.settings[NiahSettings]
    for path in (Path(m.out_dir) / f"{o.name}.json", answers_path(m, o)):
        require_own_page(path, asdict(settings), o, saved_settings)
    for line in settings.whole_budgets():
        print(line, file=sys.stderr)
    model, tokenizer = m.load(o.dtype)
    reused, sources = reused_answers(o.niah_records, settings)
    stem = Path(m.out_dir) / o.name
    partial = answers_path(m, o)
    prov = provenance(argv)
    result = run_niah(
        model, tokenizer, settings, partial, prov, m.corpus_dir, m.allow_extrapolation, reused
    )
    print(
        "\n".join([accuracy_caption(result), "", accuracy_table(result), *verdict(result.records)])
    )
    paths = write_niah_page(result, stem, f"longkv niah: {m.model}, {o.dtype}", prov, sources)
    partial.unlink()
    print("wrote " + ", ".join(map(str, paths)))
    return 0
