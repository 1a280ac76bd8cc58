"""`longkv bounded`: bounded caches of a frozen model compared with full attention, on one page
(`longkv.bench.bounded`). Partial results are kept beside the page (`<name>.nll.json`,
`<name>.niah.json`) after every step, so an interrupted run resumes; they are removed once the
page is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from longkv.bench.bounded import bounded_nll, write_bounded_page
from longkv.bench.compare import Timing, markdown_rows
from longkv.checks import require, require_at_least, setting
from longkv.cli.args import command
from longkv.cli.common import (
    ModelOptions,
    dtype_setting,
    niah_records_setting,
    require_own_page,
    require_positions,
)
from longkv.data.corpus import DEFAULT_TEXT
from longkv.evals.niah_records import NiahSettings
from longkv.evals.niah_report import accuracy_table
from longkv.evals.niah_resume import reused_answers
from longkv.evals.niah_run import check_grid, run_niah
from longkv.results import provenance


@dataclass(frozen=True)
class BoundedStudyOptions(Timing):
    """`longkv bounded`: the text the NLL is measured on, the dtype and the page's name."""

    nll_tokens: tuple[int, ...] = setting(
        (2048, 8192), "lengths of corpus text the NLL, time and peak memory are measured at"
    )
    text: str = setting(DEFAULT_TEXT, "corpus file the NLL is measured on")
    dtype: str = dtype_setting()
    name: str = setting("bounded", "file name stem of the results")
    niah_records: tuple[str, ...] = niah_records_setting()

    def __post_init__(self) -> None:
        super().__post_init__()
        require_at_least(1, self, "nll_tokens")
        shortest = min(self.nll_tokens)
        require(
            self.decode_tokens < shortest, self, "decode_tokens",
            f"{self.decode_tokens} steps do not fit the shortest --nll-tokens ({shortest})",
        )  # fmt: skip


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of `bounded`."""
    command(
        parser, run, ModelOptions, BoundedStudyOptions, NiahSettings,
        kept="the finished NLL lengths and needle answers are beside the page (.nll.json, "
        ".niah.json)",
    )  # fmt: skip


def run(args: argparse.Namespace, argv: list[str]) -> int:
    m, o = args.settings[ModelOptions], args.settings[BoundedStudyOptions]
    s = args.settings[NiahSettings]
    stem = Path(m.out_dir) / o.name
    # what the results depend on (not where reused answers were read from)
    options = {k: v for k, v in asdict(o).items() if k != "niah_records"}
    settings = {**options, **asdict(s), "model": m.model}
    require_own_page(stem.with_suffix(".json"), settings, o)
    for line in s.whole_budgets():
        print(line, file=sys.stderr)
    model, tokenizer = m.load(o.dtype)
    check_grid(model, s, m.allow_extrapolation)
    require(
        min(o.nll_tokens) <= s.exact_or_any, o, "nll_tokens",
        f"full attention, the reference of the NLL, reads up to --exact-up-to {s.exact_up_to} "
        "tokens: give at least one length within it",
    )  # fmt: skip
    longest = max(o.nll_tokens)
    full = int(min(longest, s.exact_or_any))  # the longest NLL full attention reads
    require_positions(model, full, o, "nll_tokens", f"{full} tokens", m.allow_extrapolation)
    reused, sources = reused_answers(o.niah_records, s)
    stem.parent.mkdir(parents=True, exist_ok=True)
    prov = provenance(argv)
    nll_path, niah_path = stem.with_suffix(".nll.json"), stem.with_suffix(".niah.json")
    ids = m.token_ids(model, tokenizer, longest, o.text)
    reports = bounded_nll(model, ids, s, o.nll_tokens, nll_path, settings, m.allow_extrapolation, o)
    niah = run_niah(
        model, tokenizer, s, niah_path, prov, m.corpus_dir, m.allow_extrapolation, reused
    )
    answers = json.loads(niah_path.read_text())
    payload = {"provenance": prov, "settings": settings, "nll": reports, "niah": answers}
    title = f"longkv bounded: {m.model}, {o.dtype}"
    paths = write_bounded_page(stem, title, payload, reports, niah, o.text, sources)
    nll_path.unlink()
    niah_path.unlink()
    for n in sorted(reports, key=int):  # the page's NLL, time and memory tables, then its needles
        print("\n".join([f"{n} tokens:", "", *markdown_rows(reports[n]), ""]))
    print(accuracy_table(niah))
    print("wrote " + ", ".join(map(str, paths)))
    return 0
