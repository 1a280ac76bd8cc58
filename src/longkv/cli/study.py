"""`longkv study`: a grid of model variants x seeds trained on the same rows, evaluated, and
reported (docs/study.md)."""

from __future__ import annotations

import argparse
import shlex
import sys

from longkv.results import OUT_DIR
from longkv.study.config import load_study
from longkv.study.report import write_study_report
from longkv.study.runner import RUNS_DIR, StudyData, run_study


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of `longkv study`."""
    parser.add_argument(
        "--config", required=True, help="YAML study file (docs/study.md), e.g. configs/study/x.yaml"
    )
    parser.add_argument(
        "--out-dir",
        default=OUT_DIR,
        help="folder for study_<name>.{json,md,png}; results/ holds the committed pages",
    )
    parser.add_argument(
        "--runs-dir",
        default=RUNS_DIR,
        help="parent of the study's run folders <name>/<variant>/seed<k>",
    )
    parser.add_argument("--only", nargs="+", metavar="VARIANT", help="run only these variants")
    parser.add_argument("--seeds", nargs="+", type=int, help="run only these of the study's seeds")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild the page from the finished runs, train nothing",
    )
    parser.set_defaults(func=run_study_command)


def run_study_command(args: argparse.Namespace, argv: list[str]) -> int:
    study = load_study(args.config)
    data = StudyData(study)
    if not args.report_only:
        try:
            run_study(study, args.runs_dir, variants=args.only, seeds=args.seeds, data=data)
        except KeyboardInterrupt as stop:  # checkpoints and eval.json files are atomic
            command = shlex.join(["longkv", *argv])
            print(f"longkv study: {stop or 'interrupted'}; resume with: {command}", file=sys.stderr)
            return 130
    paths = write_study_report(data, args.runs_dir, args.out_dir, argv)
    print("wrote " + ", ".join(map(str, paths)))
    return 0
