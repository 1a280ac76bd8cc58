"""`longkv study`: a grid of model variants x seeds trained on the same rows, evaluated, and
reported (docs/study.md)."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass

from longkv.checks import refused_as, setting
from longkv.cli.args import command
from longkv.results import OUT_DIR
from longkv.study.config import load_study
from longkv.study.grid import RUNS_DIR, StudyData, check_subset, run_study
from longkv.study.report import write_study_report


@dataclass(frozen=True)
class StudyOptions:
    """`longkv study`: the study file, where its runs and page go, and which runs to make."""

    config: str | None = setting(
        None, "YAML study file (docs/study.md), e.g. configs/study/x.yaml", required=True
    )
    out_dir: str = setting(
        OUT_DIR, "folder for study_<name>.{json,md,png}; results/ holds the committed pages"
    )
    runs_dir: str = setting(RUNS_DIR, "parent of the study's run folders <name>/<variant>/seed<k>")
    only: tuple[str, ...] | None = setting(None, "run only these variants")
    seeds: tuple[int, ...] | None = setting(None, "run only these of the study's seeds")
    report_only: bool = setting(False, "rebuild the page from the finished runs, train nothing")


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of `longkv study`."""
    command(parser, run_study_command, StudyOptions)


def run_study_command(args: argparse.Namespace, argv: list[str]) -> int:
    o = args.settings[StudyOptions]
    study = load_study(o.config)
    with refused_as(o, "only"):
        check_subset(study, variants=o.only)
    with refused_as(o, "seeds"):
        check_subset(study, seeds=o.seeds)
    data = StudyData(study)
    if not o.report_only:
        try:
            run_study(study, o.runs_dir, variants=o.only, seeds=o.seeds, data=data)
        except KeyboardInterrupt as stop:  # checkpoints and eval.json files are atomic
            command = shlex.join(["longkv", *argv])
            print(f"longkv study: {stop or 'interrupted'}; resume with: {command}", file=sys.stderr)
            return 130
    paths = write_study_report(data, o.runs_dir, o.out_dir, argv)
    print("wrote " + ", ".join(map(str, paths)))
    return 0
