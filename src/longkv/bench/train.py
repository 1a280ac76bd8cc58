"""`longkv bench train`: training throughput (tokens/s) of each mixer, measured in one run.

Each mixer gets the same model shape (LongKVConfig.tiny: 4 layers, d=256) and the same random
tokens; a step is forward, backward and an AdamW update on one batch of `context` tokens per
row. The variants are timed in interleaved rounds (see `run`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from longkv.bench import check_threads, ratios_table, threads_setting, use_threads
from longkv.bench.memory import keep_freed_heap
from longkv.checks import require_at_least, require_known, setting
from longkv.models import LongKVConfig, LongKVForCausalLM
from longkv.results import OUT_DIR, OUT_DIR_HELP, markdown_table, provenance, write_report
from longkv.train.run import preset_model

VARIANTS: dict[str, dict[str, Any]] = {  # LongKVConfig.tiny overrides (kvm merges into its kvm)
    "kvm_fixed": dict(  # the preset's KVM layer with a fixed budget of 64 slots (one chunk)
        mixer="kvm", kvm={"budget": "fixed", "max_state_chunks": 1}
    ),
    "kvm_sqrt": dict(mixer="kvm"),  # the tiny preset's KVM is the sqrt budget
    "kvm_saturation": dict(  # saturating at 1024 slots, as KVMConfig.paper_saturation
        mixer="kvm", kvm={"budget": "saturation", "saturation_n": 1024, "state_min_len": 1}
    ),
    "bswa": dict(mixer="bswa"),
    "full": dict(mixer="full"),
}


@dataclass(frozen=True)
class TrainBenchSettings:
    """What `longkv bench train` measures."""

    contexts: tuple[int, ...] = setting((2048, 8192), "context lengths (tokens per row)")
    variants: tuple[str, ...] = setting(tuple(VARIANTS), "mixers timed", choices=tuple(VARIANTS))
    batch: int = setting(1, "rows per step")
    repeats: int = setting(5, "timed rounds (median)")
    threads: int | None = threads_setting()
    vocab_size: int = setting(50257, "vocabulary of the random tokens and the model")
    seed: int = setting(0, "seed of the random tokens")
    out_dir: str = setting(OUT_DIR, OUT_DIR_HELP)
    name: str = setting("bench_train", "file name stem of the results")

    def __post_init__(self) -> None:
        require_known(self, "variants", self.variants, list(VARIANTS))
        require_at_least(1, self, "contexts", "batch", "repeats", "vocab_size")
        check_threads(self)


def variant_config(variant: str, vocab_size: int) -> LongKVConfig:
    """The model of `variant`: the tiny preset with its overrides, built as a run file's model
    section is (`preset_model`)."""
    return preset_model({"preset": "tiny", **VARIANTS[variant]}, vocab_size=vocab_size)


def step_seconds(model: LongKVForCausalLM, optimizer: torch.optim.Optimizer, ids: Tensor) -> float:
    """Seconds of one forward + backward + AdamW step on ids (B, T)."""
    t0 = time.perf_counter()
    loss = model(ids, labels=ids).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - t0


def run(s: TrainBenchSettings, argv: list[str] | None = None) -> dict[str, Any]:
    """Tokens per second of every variant at every context, and ratios against full.

    Per context, every variant's model is built, then `repeats` + 1 rounds each time one step
    of every variant in turn (the first round is the warm-up), so slow drifts of the machine
    touch all variants alike; a variant's time is its median over the rounds.
    """
    keep_freed_heap()
    use_threads(s.threads)
    rows = []
    for T in s.contexts:
        ids = torch.randint(
            0, s.vocab_size, (s.batch, T), generator=torch.Generator().manual_seed(s.seed)
        )
        runs = {}
        for variant in s.variants:
            torch.manual_seed(s.seed)
            config = variant_config(variant, s.vocab_size)
            model = LongKVForCausalLM(config).train()
            runs[variant] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        times: dict[str, list[float]] = {variant: [] for variant in s.variants}
        for r in tqdm(range(s.repeats + 1), desc=f"bench train {T}", unit="round"):
            for variant, (model, optimizer) in runs.items():
                seconds = step_seconds(model, optimizer, ids)
                if r:
                    times[variant].append(seconds)
        for variant in s.variants:
            seconds = statistics.median(times[variant])
            rows.append(
                {
                    "variant": variant,
                    "context": T,
                    "seconds": seconds,
                    "tokens_per_s": s.batch * T / seconds,
                }
            )
        del runs
    full = {r["context"]: r["tokens_per_s"] for r in rows if r["variant"] == "full"}
    ratios = {
        f"{r['variant']} / full tokens/s at {r['context']}": {
            "value": r["tokens_per_s"] / full[r["context"]],
            # issue 11: KVM's training within 1.3x of full attention's at 2K context
            "target": f">= {1 / 1.3:.2f}"
            if r["variant"].startswith("kvm") and r["context"] == 2048
            else None,
        }
        for r in rows
        if r["variant"] != "full" and r["context"] in full
    }
    return {"provenance": provenance(argv), "settings": asdict(s), "rows": rows, "ratios": ratios}


def save(report: dict[str, Any], s: TrainBenchSettings) -> list[Path]:
    """<out_dir>/<name>.json and .md."""
    rows = [
        [r["variant"], str(r["context"]), f"{r['seconds']:.2f}", f"{r['tokens_per_s']:.0f}"]
        for r in report["rows"]
    ]
    lines = [
        f"- model: LongKVConfig.tiny (4 layers, d=256, 4 heads), batch {s.batch}, fp32, "
        f"a step is forward, backward, AdamW; median of {s.repeats} rounds, each timing one step "
        "of every variant in turn, after a warm-up round",
        "",
        *markdown_table(["variant", "context", "s/step", "tokens/s"], rows, "<>>>"),
        "",
        *ratios_table(report["ratios"]),
    ]
    return write_report(Path(s.out_dir) / s.name, "longkv bench train", report, lines)
