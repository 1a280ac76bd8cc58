"""`longkv train`, `eval-loss`, `generate` and `tokenizer train`: longkv LMs end to end.

A run is a YAML file with `model` (a preset and LongKVConfig fields), `data` (DataConfig
fields), `train` (TrainConfig fields) and `out_dir`; `key=value` arguments override any entry
(`train.steps=10`, `model.mixer=full`), values read as YAML.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm import tqdm

from longkv.cli.args import HelpFormatter, require_known_keys, settings_from_section
from longkv.data.corpus import read_document
from longkv.models import LongKVConfig, LongKVForCausalLM
from longkv.models.pretrained import load_model, resolve_model
from longkv.results import OUT_DIR, OUT_DIR_HELP, provenance, write_atomic, write_report
from longkv.train.data import (
    DataConfig,
    document_files,
    pack_texts,
    packed_corpus,
    split_every,
    split_texts,
)
from longkv.train.loop import (
    CHECKPOINT,
    METRICS_FILE,
    MODEL_FIELDS,
    Interrupted,
    TrainConfig,
    describe,
    differences,
    evaluate,
    run_settings,
    train,
    world,
)
from longkv.train.report import (
    PROVENANCE,
    RUN_FILE,
    plot_runs,
    read_metrics,
    record_provenance,
    runs_table,
    score_run,
)
from longkv.train.tokenizer import load_tokenizer, train_bpe

PRESETS = {
    "tiny": LongKVConfig.tiny,
    "paper_120m": LongKVConfig.paper_120m,
    "paper_350m": LongKVConfig.paper_350m,
}


def load_run(path: str, overrides: list[str]) -> dict[str, Any]:
    """The run's settings: the YAML file with the dotted key=value overrides applied."""
    run = yaml.safe_load(Path(path).read_text()) or {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r}: write key=value, e.g. train.steps=10")
        *parents, leaf = key.split(".")
        node = run
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    unknown = set(run) - {"model", "data", "train", "out_dir"}
    if unknown:
        raise ValueError(
            f"run: unknown sections {sorted(unknown)}; use model, data, train, out_dir"
        )
    for section in ("model", "data", "train"):
        if not isinstance(run.get(section) or {}, dict):
            raise ValueError(
                f"{section}: must be a mapping of keys to values, got {run[section]!r}"
            )
    return run


def preset_model(section: dict[str, Any], **fixed: Any) -> LongKVConfig:
    """LongKVConfig from a model section: a preset name (default tiny) and LongKVConfig field
    overrides, over the fields `fixed` (which the section may override)."""
    require_known_keys("model", section, ["preset", *MODEL_FIELDS])
    fields = dict(section)
    preset = fields.pop("preset", "tiny")
    if preset not in PRESETS:
        raise ValueError(f"model.preset: unknown {preset!r}; choose from {sorted(PRESETS)}")
    return PRESETS[preset](**{**fixed, **fields})


def special_tokens(tokenizer: Any) -> dict[str, int | None]:
    """The tokenizer's vocabulary size and special tokens as LongKVConfig fields (so the saved
    generation_config stops at its eos)."""
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def model_config(section: dict[str, Any], tokenizer: Any) -> LongKVConfig:
    """LongKVConfig from a preset name and field overrides (see preset_model), with the
    tokenizer's vocabulary size and special tokens."""
    return preset_model(section, **special_tokens(tokenizer))


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of `train`, `eval-loss`, `generate`, `compare-runs` or `tokenizer train`."""
    {
        "train": _train_parser,
        "eval-loss": _eval_parser,
        "generate": _generate_parser,
        "compare-runs": _compare_parser,
        "tokenizer": _tokenizer_parser,
    }[name](parser)


def _run_args(p: argparse.ArgumentParser) -> None:
    """--config and the key=value overrides: a YAML run."""
    p.add_argument("--config", required=True, help="YAML run file, e.g. configs/tiny_kvm.yaml")
    p.add_argument(
        "overrides", nargs="*", help="key=value entries over the run's, e.g. train.steps=10"
    )


def _train_parser(p: argparse.ArgumentParser) -> None:
    _run_args(p)
    p.set_defaults(func=run_train)


def _eval_parser(p: argparse.ArgumentParser) -> None:
    _run_args(p)
    p.add_argument("--batches", type=int, default=16, help="held-out batches scored")
    p.set_defaults(func=run_eval)


def _generate_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a saved model folder, e.g. runs/x/model")
    p.add_argument(
        "--tokenizer", default=None, help="default: the model folder's own, else the shipped GPT-2"
    )
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens at most")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument(
        "--top-k", type=int, default=None, help="sample from the k likeliest (default: all)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.set_defaults(func=run_generate)


def _compare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", nargs="+", required=True, help="YAML runs; the first is the base")
    p.add_argument("--batches", type=int, default=64, help="held-out batches (capped at all)")
    p.add_argument("--out-dir", default=OUT_DIR, help=OUT_DIR_HELP)
    p.add_argument("--name", default="compare_runs", help="file name stem of the results")
    p.set_defaults(func=run_compare)


def _tokenizer_parser(p: argparse.ArgumentParser) -> None:
    t = p.add_subparsers(dest="tokenizer_command", required=True, metavar="ACTION").add_parser(
        "train",
        help="train a byte-level BPE on a corpus's training documents",
        description="Train a byte-level BPE on a corpus's training documents.",
        formatter_class=HelpFormatter,
    )
    t.add_argument("--out", required=True, help="folder for the tokenizer (data.tokenizer)")
    t.add_argument("--vocab-size", type=int, default=8192, help="tokens in the vocabulary")
    t.add_argument(
        "--min-frequency", type=int, default=2, help="fewest occurrences of a pair to merge"
    )
    t.add_argument(
        "--corpus-dir",
        default=None,
        help="folder of training documents (default: $LONGKV_CORPUS_DIR)",
    )
    t.add_argument(
        "--every", type=int, default=20, help="every n-th document is held out, never seen"
    )
    t.set_defaults(func=run_tokenizer_train)


def _settings(run: dict[str, Any]) -> tuple[DataConfig, TrainConfig, Path]:
    """The run's data and train sections, validated, and its out_dir."""
    data = settings_from_section(DataConfig, "data", run.get("data") or {})
    cfg = settings_from_section(TrainConfig, "train", run.get("train") or {})
    return data, cfg, Path(run.get("out_dir", "runs/longkv"))


def run_train(args: argparse.Namespace, argv: list[str]) -> int:
    run = load_run(args.config, args.overrides)
    data, cfg, out = _settings(run)
    rank, command = world()[0], shlex.join(["longkv", *argv])
    try:
        tokenizer = load_tokenizer(data.tokenizer)
        config = model_config(run.get("model") or {}, tokenizer)
        text = packed_corpus(tokenizer, data)
        metrics = train(config, cfg, text.train, text.held_out, out, data=asdict(data))
        if rank != 0:
            return 0
        record_provenance(out / PROVENANCE, provenance(argv))  # the run's finishing invocation
        tokenizer.save_pretrained(out / "model")  # generate finds it beside the weights
        recorded = {
            "model": run.get("model") or {}, "data": asdict(data), "train": asdict(cfg),
            "out_dir": str(out),
        }  # fmt: skip
        write_atomic(out / RUN_FILE, yaml.safe_dump(recorded, sort_keys=False))  # for eval-loss
    except KeyboardInterrupt as stop:  # no traceback: where the run stands and how to go on
        if rank == 0 and isinstance(stop, Interrupted):
            again = "resume with" if stop.checkpoint_step else "nothing to resume; rerun with"
            print(f"longkv train: {stop}; {again}: {command}", file=sys.stderr)
        elif rank == 0:  # outside the steps, which lose nothing (checkpoints are atomic)
            print(
                f"longkv train: interrupted outside the training steps; rerun: {command}",
                file=sys.stderr,
            )
        return 130
    last = metrics[-1]
    eval_loss = last.get("eval_loss", float("nan"))
    print(f"step {last['step']}: loss {last['loss']:.4f}, eval loss {eval_loss:.4f}")
    print(f"wrote {out}/{CHECKPOINT}, {out}/{METRICS_FILE}, {out}/model, {out}/{RUN_FILE}")
    return 0


def finished_run(
    config: str, run: dict[str, Any], flag: str
) -> tuple[DataConfig, TrainConfig, Path, Any]:
    """The finished run in run's out_dir with the settings it recorded in RUN_FILE: its data,
    train settings, out_dir and own tokenizer (saved beside the weights).

    config: the run file run came from, and flag the CLI flag that named it (for the errors). A
    run without RUN_FILE (unfinished), or one whose recorded settings (model, data, train;
    out_dir aside) differ from run's, is refused naming each difference.
    """
    data, cfg, out = _settings(run)
    path, recorded_path = out / "model", out / RUN_FILE  # written when `longkv train` finishes
    if not (path / "config.json").is_file() or not recorded_path.is_file():
        raise FileNotFoundError(
            f"{flag} {config}: no finished run in {out} (its model/ and {RUN_FILE}); finish "
            f"`longkv train --config {config}` first"
        )
    recorded = load_run(str(recorded_path), [])
    own_data, own_cfg, _ = _settings(recorded)
    tokenizer = load_tokenizer(path)
    changed = differences(
        run_settings(
            model_config(recorded.get("model") or {}, tokenizer), own_cfg, asdict(own_data)
        ),
        run_settings(model_config(run.get("model") or {}, tokenizer), cfg, asdict(data)),
    )
    if changed:
        raise ValueError(
            f"{flag} {config}: not the settings of the run in {out} ({describe(changed)}"
            f"; recorded -> given); use the run's own: {flag} {recorded_path}"
        )
    return own_data, own_cfg, out, tokenizer


def run_eval(args: argparse.Namespace, argv: list[str]) -> int:
    data, cfg, out, tokenizer = finished_run(
        args.config, load_run(args.config, args.overrides), "--config"
    )
    model = LongKVForCausalLM.from_pretrained(out / "model").eval()
    held = pack_texts(tokenizer, split_texts(data)[1], data.seq_len)
    loss = evaluate(model, held, args.batches, cfg.batch_size)
    print(f"held-out loss {loss:.4f} over {args.batches} batches of {cfg.batch_size}")
    return 0


def run_generate(args: argparse.Namespace, argv: list[str]) -> int:
    path = resolve_model(args.model)
    model = load_model(path)  # any causal LM, as what it is; a longkv model is one
    own = (Path(path) / "tokenizer_config.json").is_file()
    tokenizer = load_tokenizer(args.tokenizer or (path if own else None))
    eos = model.generation_config.eos_token_id  # the model's own, else the tokenizer's
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k or 0}
        if args.sample
        else {"do_sample": False}
    )  # top_k 0: every token
    torch.manual_seed(args.seed)
    out = model.generate(
        **tokenizer(args.prompt, return_tensors="pt"), max_new_tokens=args.max_new_tokens,
        eos_token_id=tokenizer.eos_token_id if eos is None else eos, **sampling,
    )  # fmt: skip
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    return 0


def run_tokenizer_train(args: argparse.Namespace, argv: list[str]) -> int:
    train_files, held_files = split_every(document_files(args.corpus_dir), args.every)
    tokenizer = train_bpe(train_files, args.vocab_size, args.out, min_frequency=args.min_frequency)
    text = "".join(read_document(f) for f in held_files[:3])
    per_token = len(text) / max(1, len(tokenizer(text)["input_ids"]))
    short = "" if len(tokenizer) == args.vocab_size else " (no more pairs seen often enough)"
    print(f"{len(tokenizer)} tokens{short}; {per_token:.2f} characters per held-out token")
    print(f"wrote {args.out}; use it with data.tokenizer={args.out}")
    return 0


def run_compare(args: argparse.Namespace, argv: list[str]) -> int:
    # each run with its own recorded settings; the first run's own tokenizer packs the rows
    runs = [(Path(c).stem, *finished_run(c, load_run(c, []), "--configs")) for c in args.configs]
    base, data, base_cfg, _, tokenizer = runs[0]
    differ = "; ".join(
        f"{label}: {describe(changed)}"
        for label, own, *_ in runs[1:]
        if (changed := differences({"data": asdict(data)}, {"data": asdict(own)}))
    )
    if differ:
        raise ValueError(
            f"--configs: the runs recorded different data sections, so their held-out rows "
            f"would differ too ({differ}; {base} -> that run); compare runs trained on the "
            "same data"
        )
    held = pack_texts(tokenizer, split_texts(data)[1], data.seq_len)
    results = [
        score_run(label, out, cfg.batch_size, held, base_cfg.batch_size, args.batches)
        for label, _, cfg, out, _ in tqdm(runs, desc="score", unit="run")
    ]
    stem = Path(args.out_dir) / args.name
    table = runs_table(results)
    body = [
        "",
        f"Held-out loss: mean next-token loss over the same {results[0].held_out_tokens:,} "
        "held-out tokens for every run (documents never trained on). Train minutes: the "
        "runs' own clock (metrics.csv `seconds`: steps and evaluations, not checkpoint writes).",
        "",
        *table,
        "",
        *[f"- {r.label}: {r.trained_by}" for r in results],
        "",
        f"![loss curves]({stem.name}.png)",
    ]
    payload = {"provenance": provenance(argv), "runs": [asdict(r) for r in results]}
    print("\n".join(table))
    write_report(stem, "longkv compare-runs: " + ", ".join(args.configs), payload, body)
    curves = {label: read_metrics(out / METRICS_FILE) for label, _, _, out, _ in runs}
    plot_runs(curves, stem.with_suffix(".png"), "loss curves: " + ", ".join(curves))
    print(f"wrote {stem}.json, {stem}.md, {stem}.png")
    return 0
