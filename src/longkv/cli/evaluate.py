"""`longkv eval`: lm-evaluation-harness tasks on a longkv model or any causal LM."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from longkv.checks import require, require_at_least, setting
from longkv.cli.args import command
from longkv.cli.common import require_own_page
from longkv.models.pretrained import DEFAULT_MODEL, resolve_model
from longkv.results import OUT_DIR, OUT_DIR_HELP, provenance, write_report

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype -> lm-eval's


@dataclass(frozen=True)
class HarnessOptions:
    """`longkv eval`: the model, the tasks and how lm-eval runs them."""

    model: str = setting(
        DEFAULT_MODEL,
        f"a model folder (a trained longkv run's model/, any causal LM), a hub id, or "
        f"{DEFAULT_MODEL} (SmolLM2-135M-Instruct)",
    )
    tasks: tuple[str, ...] = setting(
        (),
        "lm-eval task names, e.g. lambada_openai piqa, or tasks of --include-path",
        required=True,
    )
    include_path: str | None = setting(None, "a folder of lm-eval task YAML files")
    batch_size: int = setting(1, "requests per forward (any request type)")
    max_length: int = setting(2048, "tokens per forward at most (lm-eval's rolling window)")
    limit: int | None = setting(None, "documents per task at most (default: all)")
    num_fewshot: int | None = setting(None, "few-shot examples (default: each task's own)")
    device: str = setting("cpu", "torch device, e.g. cuda")
    dtype: str = setting("fp32", "weights and activations", choices=tuple(DTYPE_NAMES))
    log_samples: bool = setting(False, "keep every request and answer in the JSON")
    out_dir: str = setting(OUT_DIR, OUT_DIR_HELP)
    name: str = setting("eval", "file name stem of the results")

    def __post_init__(self) -> None:
        require_at_least(1, self, "batch_size", "max_length")
        require(self.limit is None or self.limit >= 1, self, "limit", "must be >= 1 (or unset)")
        require(
            self.include_path is None or Path(self.include_path).is_dir(), self, "include_path",
            f"{self.include_path!r} is not a folder of task files",
        )  # fmt: skip


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    command(parser, run_eval, HarnessOptions)


def run_eval(args: argparse.Namespace, argv: list[str]) -> int:
    o = args.settings[HarnessOptions]
    stem = Path(o.out_dir) / o.name
    require_own_page(stem.with_suffix(".json"), asdict(o), o)
    try:
        from longkv.evals.harness import run_harness
    except ImportError as err:
        raise ValueError(
            f"eval: needs lm-evaluation-harness ({err}); pip install 'longkv[eval]'"
        ) from err
    from lm_eval.utils import handle_non_serializable, make_table

    out = run_harness(
        resolve_model(o.model), list(o.tasks), include_path=o.include_path,
        batch_size=o.batch_size, max_length=o.max_length, limit=o.limit,
        num_fewshot=o.num_fewshot, device=o.device, dtype=DTYPE_NAMES[o.dtype],
        log_samples=o.log_samples,
    )  # fmt: skip
    table = make_table(out)
    kept = ("results", "versions", "n-shot", "higher_is_better", "n-samples", "samples")
    found: dict[str, Any] = {key: out[key] for key in kept if key in out}
    payload = {
        "provenance": provenance(argv),
        "settings": asdict(o),
        **json.loads(json.dumps(found, default=handle_non_serializable)),
    }
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = write_report(stem, f"lm-eval: {', '.join(o.tasks)}", payload, ["", table])
    print(table)
    print("wrote " + ", ".join(map(str, paths)))
    return 0
