"""Needle-in-a-haystack over lengths x depths x methods: full attention, KV-Fold and the bounded
caches (StreamingLLM, SnapKV, KVM-Fold at each budget), answered sample by sample.

Every method answers the same prompt by greedy decoding: `full` from one pass over the whole
prompt, `fold` from a fold in chunks, a bounded method (labelled like `kvm-fold/sqrt@1024`,
`longkv.caches.methods`) from its cache after reading the prompt in chunks. Records are written
to the JSON file after every answer (atomically), and a rerun with the same settings reuses
those of an unfinished grid, so an interrupted grid loses nothing; a finished grid (such as a
committed result) is run again. The settings, records and scores are in `niah_records`, which
saved answers a run takes in `niah_resume`, the page's table and figures in `niah_report`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from longkv.caches.kvm_fold import KVMFoldRunner
from longkv.caches.methods import keeps_positions, make_runner, read_and_answer
from longkv.caches.retrieval import RetrievalRunner, check_exact_positions
from longkv.checks import refuse, refused_as
from longkv.evals.niah import ANSWER_BUDGET, NiahSample, answer_span, make_sample, sample_score
from longkv.evals.niah_records import EXACT, NiahRecord, NiahRun, NiahSettings
from longkv.evals.niah_resume import saved_records
from longkv.fold.compat import input_device
from longkv.fold.fold import CLI_SWITCH, check_foldable, check_positions
from longkv.fold.variants import check_variant, inserted_positions


def answer(
    model: nn.Module,
    ids: torch.Tensor,
    method: str,
    s: NiahSettings,
    eos: int | None,
    allow_extrapolation: bool = False,
    span: tuple[int, int] | None = None,
) -> tuple[list[int], dict[str, float] | None]:
    """Greedy answer tokens of one method run (a label of `s.runs`) to the prompt ids (1, T),
    and for kvm-fold where the tokens of `span` went (`KVMFoldRunner.fates`; else None), with,
    for a retrieval cache (two-level KVM-Fold, Quest, InfLLM), how the prompt's last query
    routed to them (`RetrievalRunner.needle_route`). A chunked read shows its progress (a bar
    that goes when it is done).

    allow_extrapolation lets full and fold run a RoPE model past its max_position_embeddings
    (`fold_generate`)."""
    fate: dict[str, float] | None = None
    route: dict[str, float] = {}
    bounded = method not in ("full", "fold")
    runner = (
        make_runner(model, s.bounded_configs(s.methods)[method], track=True) if bounded else None
    )

    def routed() -> None:  # how the prompt's last query routed to the answer
        if isinstance(runner, RetrievalRunner) and span is not None:
            route.update(runner.needle_route(*span))

    out = read_and_answer(
        model, ids, method, s.max_new_tokens, runner=runner, chunk_size=s.chunk_size,
        variant=s.variant, stream_chunk=s.stream_chunk, eos_token_id=eos,
        allow_extrapolation=allow_extrapolation, after_prompt=routed,
    )  # fmt: skip
    if isinstance(runner, KVMFoldRunner) and span is not None:
        fate = {**runner.fates(*span), **route}
    elif route:
        fate = route
    tokens = out[0].tolist()
    return tokens[: tokens.index(eos)] if eos is not None and eos in tokens else tokens, fate


def run_niah(
    model: nn.Module,
    tokenizer: Any,
    s: NiahSettings,
    path: Path,
    provenance: dict[str, Any] | None = None,
    corpus_dir: str | None = None,
    allow_extrapolation: bool = False,
    reuse: list[NiahRecord] | None = None,
) -> NiahRun:
    """Answer every sample of the grid with every method; save after each answer.

    The whole grid is checked first (`check_grid`, then every prompt is built), so a setting
    the model or a task cannot run fails before the first answer. allow_extrapolation lets
    full attention and the fold run a RoPE model past its max_position_embeddings. reuse:
    answers given elsewhere to this grid (`reusable_records`), taken instead of answering.
    """
    keys = s.keys
    saved = saved_records(path, s)
    if len(saved) == len(keys):  # finished: measure again
        saved = []
    known = {r.key for r in saved}
    saved += [r for r in reuse or [] if r.key not in known]
    run = NiahRun(settings=s, records=saved, provenance=provenance or {})
    done = {r.key for r in run.records}
    todo: dict[tuple[str, int, float, int], list[str]] = {c: [] for c in s.cells}
    for key in keys:
        if key not in done:
            todo[key[:4]].append(key[4])
    check_grid(model, s, allow_extrapolation)
    samples = build_samples(tokenizer, [c for c in todo if todo[c]], corpus_dir)
    eos = getattr(tokenizer, "eos_token_id", None)
    reused = f", {len(done)} of {len(keys)} answers reused" if done else ""
    progress = tqdm(total=sum(map(len, todo.values())), desc=f"niah{reused}", unit="answer")
    for (task, n, d, seed), sample in samples.items():
        ids = torch.tensor([sample.input_ids], device=input_device(model))
        span = answer_span(tokenizer, sample)
        for method in todo[(task, n, d, seed)]:
            t0 = time.perf_counter()
            tokens, fate = answer(model, ids, method, s, eos, allow_extrapolation, span)
            prediction = tokenizer.decode(tokens, skip_special_tokens=True)
            run.records.append(
                NiahRecord(
                    task=task,
                    context_len=n,
                    depth=d,
                    seed=seed,
                    method=method,
                    answers=list(sample.answers),
                    prediction=prediction,
                    tokens=tokens,
                    score=sample_score(prediction, sample.answers),
                    seconds=time.perf_counter() - t0,
                    needle_fate=fate,
                )
            )
            run.save(path)
            progress.update()
    progress.close()
    run.save(path)
    return run


def check_grid(model: nn.Module, s: NiahSettings, allow_extrapolation: bool = False) -> None:
    """SettingError (naming the setting to change) if the model cannot run the grid's methods
    at its lengths; ValueError if it cannot run a method at all. Nothing is run.

    Full attention and the fold run past max_position_embeddings only on a RoPE model with
    allow_extrapolation (`check_positions`); a bounded cache never needs to, and a retrieval
    cache (two-level KVM-Fold, Quest, InfLLM), which keeps every token at its own position,
    never does; full attention and the fold are checked up to the longest length they answer
    (`NiahSettings.exact_up_to`)."""
    configs = s.check_runs(model, s.methods)
    exact = [label for label, c in configs.items() if keeps_positions(c)]
    n = max(s.lengths)
    # the prompt (length - ANSWER_BUDGET tokens), then all but the last answer token
    needed = n - ANSWER_BUDGET + s.max_new_tokens - 1
    if exact:
        with refused_as(s, "lengths", f"{exact[0]}: {{}}"):
            check_exact_positions(model.config, needed, f"{n} (the prompt, then the answer)")
    if EXACT & set(s.methods):
        n = max(length for length in s.lengths if length <= s.exact_or_any)
        needed = n - ANSWER_BUDGET + s.max_new_tokens - 1
        inserted = (
            inserted_positions(s.variant, n - ANSWER_BUDGET, s.chunk_size)
            if "fold" in s.methods
            else 0
        )
        needed += inserted
        what = "the prompt, then the answer" + (
            ", and the fold's BOS before every chunk" if inserted else ""
        )
        with refused_as(s, "lengths"):
            check_positions(
                model.config, needed, f"{n} under full attention and the fold ({what})",
                allow_extrapolation=allow_extrapolation, switch=CLI_SWITCH,
            )  # fmt: skip
        if "fold" in s.methods:
            with refused_as(s, "variant"):
                check_variant(s.variant, model)
        check_foldable(model, needed, allow_extrapolation=allow_extrapolation)


def build_samples(
    tokenizer: Any, cells: list[tuple[str, int, float, int]], corpus_dir: str | None = None
) -> dict[tuple[str, int, float, int], NiahSample]:
    """The sample of every cell (task, length, depth, seed); a length too short for its task is
    a SettingError on `lengths`."""
    samples = {}
    for task, n, d, seed in tqdm(cells, desc="prompts", unit="prompt", leave=False):
        try:
            samples[(task, n, d, seed)] = make_sample(
                task, tokenizer, n, d, seed, corpus_dir=corpus_dir
            )
        except ValueError as err:
            refuse(NiahSettings, "lengths", f"{n} for {task}: {err}")
    return samples
