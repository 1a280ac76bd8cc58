"""`longkv train`, `longkv eval-loss`, `longkv generate`: longkv language models end to end.

A run is a YAML file with `model` (a preset and LongKVConfig fields), `data` (seq_len, folder,
every), `train` (TrainConfig fields) and `out_dir`; `key=value` arguments override any entry
(`train.steps=10`, `model.mixer=full`), values read as YAML.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import yaml

from longkv.models import LongKVConfig, LongKVForCausalLM
from longkv.train.data import (
    document_files,
    gpt2_tokenizer,
    pack_files,
    packed_corpus,
    split_files,
)
from longkv.train.loop import TrainConfig, evaluate, train

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
    return run


def model_config(section: dict[str, Any], vocab_size: int) -> LongKVConfig:
    """LongKVConfig from a preset name and field overrides."""
    fields = dict(section)
    preset = fields.pop("preset", "tiny")
    if preset not in PRESETS:
        raise ValueError(f"model.preset: unknown {preset!r}; choose from {sorted(PRESETS)}")
    return PRESETS[preset](**{"vocab_size": vocab_size, **fields})


def add_parsers(commands: argparse._SubParsersAction) -> None:
    """Register `train`, `eval-loss` and `generate`."""
    p = commands.add_parser("train", help="train a longkv language model from a YAML run")
    p.add_argument("--config", required=True, help="YAML run file, e.g. configs/tiny_kvm.yaml")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. train.steps=10")
    p.set_defaults(func=run_train)
    e = commands.add_parser("eval-loss", help="held-out loss of a trained run")
    e.add_argument("--config", required=True)
    e.add_argument("overrides", nargs="*")
    e.add_argument("--batches", type=int, default=16)
    e.set_defaults(func=run_eval)
    g = commands.add_parser("generate", help="continue a prompt with a trained model")
    g.add_argument("--model", required=True, help="a saved model folder, e.g. runs/x/model")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--sample", action="store_true", help="sample instead of greedy")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=run_generate)


def _data(run: dict[str, Any]) -> tuple[int, str | None, int]:
    """(seq_len, folder, every) of the run's data section."""
    data = run.get("data", {})
    return data.get("seq_len", 512), data.get("folder"), data.get("every", 20)


def run_train(args: argparse.Namespace, argv: list[str]) -> int:
    run = load_run(args.config, args.overrides)
    tokenizer = gpt2_tokenizer()
    config = model_config(run.get("model", {}), len(tokenizer))
    cfg = TrainConfig(**run.get("train", {}))
    text = packed_corpus(tokenizer, *_data(run))
    out = run.get("out_dir", "runs/longkv")
    metrics = train(config, cfg, text.train, text.held_out, out)
    last = metrics[-1]
    eval_loss = last.get("eval_loss", float("nan"))
    print(f"step {last['step']}: loss {last['loss']:.4f}, eval loss {eval_loss:.4f}")
    print(f"wrote {out}/checkpoint.pt, {out}/metrics.csv, {out}/model")
    return 0


def run_eval(args: argparse.Namespace, argv: list[str]) -> int:
    run = load_run(args.config, args.overrides)
    cfg = TrainConfig(**run.get("train", {}))
    seq_len, folder, every = _data(run)
    held = pack_files(gpt2_tokenizer(), split_files(document_files(folder), every)[1], seq_len)
    path = Path(run.get("out_dir", "runs/longkv")) / "model"  # written by `longkv train`
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no trained model in {path}; run `longkv train` with this run")
    model = LongKVForCausalLM.from_pretrained(path).eval()
    loss = evaluate(model, held, args.batches, cfg.batch_size)
    print(f"held-out loss {loss:.4f} over {args.batches} batches of {cfg.batch_size}")
    return 0


def run_generate(args: argparse.Namespace, argv: list[str]) -> int:
    model = LongKVForCausalLM.from_pretrained(args.model).eval()
    tokenizer = gpt2_tokenizer()
    ids = torch.tensor([tokenizer(args.prompt)["input_ids"]])
    out = model.generate(
        ids, args.max_new_tokens, do_sample=args.sample, temperature=args.temperature,
        top_k=args.top_k, eos_token_id=tokenizer.eos_token_id,
        generator=torch.Generator().manual_seed(args.seed),
    )  # fmt: skip
    print(tokenizer.decode(out[0]))
    return 0
