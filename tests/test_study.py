"""`longkv study`: a tiny grid end to end, skipping finished runs, exact resume, config errors."""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import yaml

from longkv.bench.train import variant_config
from longkv.cli.main import main
from longkv.evals.synthetic import make_mqar, query_distance
from longkv.models import LongKVConfig
from longkv.study import grid
from longkv.study.config import load_study, study_from_mapping
from longkv.study.grid import EVAL_FILE, StudyData, mqar_rows, run_dir, run_study
from longkv.study.mqar_config import EVAL, derived_seed
from longkv.study.records import by_lead
from longkv.study.report import below_half, describe_study
from longkv.train import config as train_config
from longkv.train import loop
from longkv.train.data import pack_texts, split_texts
from longkv.train.run import load_run, preset_model

EXAMPLE = Path(__file__).resolve().parents[1] / "configs" / "study" / "example_mqar.yaml"
TINY_MODEL = {
    "preset": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 4, "swa_window": 8,
    "kvm": {"chunk_len": 4, "window_chunks": 1, "state_min_len": 4, "rope_dim": 4},
}  # fmt: skip
TRAIN = {"steps": 3, "batch_size": 4, "warmup": 1, "eval_every": 3, "eval_batches": 1,
         "checkpoint_every": 1}  # fmt: skip
MQAR: dict[str, Any] = {
    "name": "tiny",
    "task": "mqar",
    "seeds": [0, 1],
    "model": TINY_MODEL,
    "variants": {"full": {"mixer": "full"}, "kvm": {"mixer": "kvm"}},
    "train": TRAIN,
    "mqar": {
        "train": {
            "seq_len": 16,
            "num_pairs": [2, 3],
            "rows": 16,
            "held_out_rows": 8,
            "vocab_size": 32,
            "filler_vocab": 8,
        },
        "eval": {
            "num_pairs": [2, 3],
            "gaps": [0, 8],
            "rows": 4,
            "batch_size": 2,
            "distance_edges": [0, 8, 32],
        },
    },
}


def write(path: Path, study: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(study))
    return str(path)


def eval_files(runs: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in sorted(runs.rglob(EVAL_FILE))}


def untimed(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != "train_seconds"}


def test_a_tiny_mqar_grid_runs_end_to_end_then_skips_when_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path / "study.yaml", MQAR)
    argv = ["study", "--config", config, "--out-dir", str(tmp_path / "out"),
            "--runs-dir", str(tmp_path / "runs")]  # fmt: skip
    assert main(argv) == 0
    assert "kvm seed 1 (4/4)" in capsys.readouterr().err  # the trainer's bar names the run
    stem = tmp_path / "out" / "study_tiny"
    page = json.loads(stem.with_suffix(".json").read_text())
    assert set(page) == {"provenance", "study", "runs", "mean", "missing"}
    assert page["missing"] == [] and len(page["runs"]) == 4
    assert page["study"]["mqar"]["eval"]["gaps"] == [0, 8] and "seed" not in page["study"]["train"]
    kvm, full = page["mean"]["kvm"], page["mean"]["full"]
    assert [(p["num_pairs"], p["gap"], p["seq_len"]) for p in kvm["points"]] == [
        (2, 0, 8), (2, 8, 16), (3, 0, 12), (3, 8, 20),
    ]  # fmt: skip
    assert all(p["state_slots"] is None for p in full["points"])  # no kvm layer
    assert all(p["state_slots"] >= 1 for p in kvm["points"])
    seeds = [r for r in page["runs"] if r["variant"] == "kvm"]
    assert kvm["points"][0]["accuracy"] == pytest.approx(
        (seeds[0]["points"][0]["accuracy"] + seeds[1]["points"][0]["accuracy"]) / 2
    )
    assert all(r["steps"] == 3 and r["settings"]["train"]["seed"] == r["seed"] for r in seeds)
    assert [c for r in seeds for c in r["held_out_curve"]] == [
        [3, pytest.approx(r["eval_loss"])] for r in seeds
    ]  # metrics.csv's held-out losses (eval_every = steps = 3)
    md = stem.with_suffix(".md").read_text()
    assert "## Accuracy (%, mean over seeds)" in md and "| kvm s1 |" in md.replace(" | ", " |\n| ")
    assert "## State size" in md and "## Training" in md and "Token shift is off." in md
    assert "queries = pairs, the gap filling the rest)" in md
    # (32 ids - 8 filler) / 2 = 12 value ids: chance is ln 12 nats, 1/12 of the answers
    assert "Chance is a held-out loss of ln 12 = 2.48" in md and "and 8.3 % with one-token" in md
    assert stem.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"

    before = eval_files(tmp_path / "runs")
    assert len(before) == 4

    def no_training(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr("longkv.study.grid.train", no_training)
    assert main(argv) == 0  # everything finished: nothing trained, nothing rewritten
    assert eval_files(tmp_path / "runs") == before
    assert main([*argv[:-2], "--runs-dir", str(tmp_path / "other"), "--report-only"]) == 0
    page = json.loads(stem.with_suffix(".json").read_text())
    assert page["runs"] == [] and len(page["missing"]) == 4  # no finished runs there


def test_an_interrupted_run_resumes_to_the_numbers_of_an_uninterrupted_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    study = study_from_mapping(MQAR)
    data = StudyData(study)  # the rows are made once and shared by the runs
    whole = run_study(study, tmp_path / "a", variants=["kvm"], seeds=[1], data=data)
    lr_factor = train_config.lr_factor

    def ctrl_c_at_step_2(step: int, warmup: int, steps: int) -> float:
        if step == 1:
            raise KeyboardInterrupt
        return lr_factor(step, warmup, steps)

    monkeypatch.setattr(train_config, "lr_factor", ctrl_c_at_step_2)
    config = write(tmp_path / "study.yaml", MQAR)
    argv = ["study", "--config", config, "--runs-dir", str(tmp_path / "b"), "--only", "kvm",
            "--seeds", "1", "--out-dir", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 130
    assert "holds step 1" in capsys.readouterr().err
    out = run_dir(tmp_path / "b", study, "kvm", 1)
    assert (out / loop.CHECKPOINT).is_file() and not (out / EVAL_FILE).exists()
    monkeypatch.setattr(train_config, "lr_factor", lr_factor)
    resumed = run_study(study, tmp_path / "b", variants=["kvm"], seeds=[1], data=data)
    assert untimed(resumed["kvm", 1]) == untimed(whole["kvm", 1])
    recorded = json.loads((out / EVAL_FILE).read_text())
    assert untimed(recorded) == untimed(whole["kvm", 1])


class StepBar:
    """tqdm's stand-in in longkv.study.grid: records the study bar's updates, passes an
    iterable (an evaluation's points) through."""

    made: ClassVar[list[StepBar]] = []

    def __init__(self, iterable: Any = None, **kwargs: Any) -> None:
        self.iterable, self.total, self.n, self.updates = iterable, kwargs.get("total"), 0, []
        StepBar.made.append(self)

    def __iter__(self) -> Any:
        return iter(self.iterable)

    def update(self, k: int = 1) -> None:
        self.n += k
        self.updates.append(k)

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_study_bar_counts_every_runs_training_steps_so_its_eta_is_the_studys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grid, "tqdm", StepBar)
    study = study_from_mapping(MQAR)
    steps = study.train_config(0).steps
    run_study(study, tmp_path, variants=["kvm"], seeds=[0, 1])
    bar = next(b for b in StepBar.made if b.total is not None)
    assert bar.total == 2 * steps and bar.n == 2 * steps
    assert bar.updates == ([1] * steps + [0]) * 2  # a step at a time, nothing left at the end
    StepBar.made.clear()
    run_study(study, tmp_path, variants=["kvm"], seeds=[0, 1])  # finished: skipped
    bar = next(b for b in StepBar.made if b.total is not None)
    assert bar.updates == [steps, steps]


def test_changed_settings_of_a_finished_run_are_refused_naming_them(tmp_path: Path) -> None:
    study = study_from_mapping(MQAR)
    run_study(study, tmp_path, variants=["full"], seeds=[0])
    other = copy.deepcopy(MQAR)
    other["train"]["lr"] = 5e-4
    with pytest.raises(ValueError, match=r"train\.lr: 0\.001 -> 0\.0005; recorded -> given"):
        run_study(study_from_mapping(other), tmp_path, variants=["full"], seeds=[0])
    rescored = copy.deepcopy(MQAR)
    rescored["mqar"]["eval"]["gaps"] = [4]  # only the evaluation changed: evaluated again
    record = run_study(study_from_mapping(rescored), tmp_path, variants=["full"], seeds=[0])
    assert [p["gap"] for p in record["full", 0]["points"]] == [4, 4]


def test_variants_merge_into_the_shared_model_and_the_presets_kvm() -> None:
    study = copy.deepcopy(MQAR)
    study["variants"]["fixed"] = {"kvm": {"budget": "fixed"}, "token_shift": True}
    built = study_from_mapping(study)
    fixed, sqrt = built.model_config("fixed"), built.model_config("kvm")
    assert fixed.kvm == {**sqrt.kvm, "budget": "fixed"}  # only the budget changed
    assert sqrt.kvm["growth_factor"] == 4.0 and sqrt.kvm["chunk_len"] == 4  # preset, then model
    assert fixed.token_shift and not sqrt.token_shift
    assert fixed.vocab_size == 32 and built.model_config("full").mixer == "full"


def test_one_model_section_builds_one_model_under_train_study_and_bench(tmp_path: Path) -> None:
    run_file = tmp_path / "run.yaml"
    run_file.write_text(
        "model: {preset: tiny, mixer: kvm, kvm: {budget: fixed, max_state_chunks: 1}}"
    )
    section = load_run(run_file, [])["model"]
    by_train = preset_model(section, vocab_size=32)
    study = copy.deepcopy(MQAR)
    study["model"], study["variants"] = section, {"kvm_fixed": {}}
    by_study = study_from_mapping(study).model_config("kvm_fixed")
    by_bench = variant_config("kvm_fixed", 32)
    assert by_train.to_dict() == by_study.to_dict() == by_bench.to_dict()
    # the run file's kvm merged into the preset's: only the budget and its cap changed
    preset = LongKVConfig.tiny().kvm
    assert by_train.kvm == {**preset, "budget": "fixed", "max_state_chunks": 1}


def test_mqar_rows_are_the_union_of_the_combinations_at_the_fixed_length() -> None:
    spec = study_from_mapping(MQAR).mqar
    assert spec is not None
    train, held = mqar_rows(spec.train)
    assert train.ids.shape == (16, 16) and held.ids.shape == (8, 16)
    scored = (train.labels != -100).sum(1)
    assert sorted(set(scored.tolist())) == [2, 3]  # num_pairs 2 and 3, one token per value
    assert (scored == 2).sum() == (scored == 3).sum() == 8  # equal rows per combination
    again, _ = mqar_rows(spec.train)
    assert (again.ids == train.ids).all()  # the same rows for every run


def test_training_gaps_keep_the_length_with_filler_before_the_pairs() -> None:
    study = copy.deepcopy(MQAR)
    study["mqar"]["train"].update(gaps=[0, 3, 100], rows=24, held_out_rows=6)  # 100: > any rest
    config = study_from_mapping(study)
    page = "\n".join(describe_study(config, StudyData(config)))
    assert "gaps [0, 3, 100] capped at the rest, filler before the pairs filling it" in page
    spec = config.mqar
    assert spec is not None
    configs = spec.train.configs(0)
    rests = [16 - 4 * c.num_pairs for c in configs]
    assert [c.gap for c in configs] == [
        min(g, r) for g, r in zip([0, 3, 100] * 2, rests, strict=True)
    ]
    assert all(c.lead + c.gap == r and c.seq_len == 16 for c, r in zip(configs, rests, strict=True))
    train, _ = mqar_rows(spec.train)
    assert train.ids.shape == (24, 16)
    distances = [query_distance(make_mqar(c, 4)).min().item() for c in configs]
    assert distances[0] < distances[2]  # a gap of 0 asks pairs nearer than the whole rest


def test_a_study_trains_after_novel_leads_and_scores_every_lead_length_and_kind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    study = copy.deepcopy(MQAR)
    study["seeds"] = [0]
    study["variants"] = {"kvm": {"mixer": "kvm", "kvm": {"budget": "fixed"}}}  # 4 slots
    study["mqar"]["train"].update(
        seq_len=24, gaps=[0, 4], rows=8, held_out_rows=4, vocab_size=64, lead_kind="novel",
        lead_vocab=32,
    )  # fmt: skip
    study["mqar"]["eval"].update(gaps=[0], leads=[0, 16], lead_kinds=["novel", "repeated"])
    config = study_from_mapping(study)
    assert config.mqar is not None
    lead_ids = range(2 * 12 + 8, 2 * 12 + 8 + 32)  # (64 - 8 - 32) / 2 = 12 keys, 12 values
    train, _ = mqar_rows(config.mqar.train)
    for c in config.mqar.train.configs(0):  # the lead fills what the pairs and gap leave
        assert c.lead_kind == "novel" and c.lead == 24 - 4 * c.num_pairs - c.gap
    firsts = {int(row[0]) for row in train.ids}
    assert firsts <= set(lead_ids)  # every training row starts with lead ids
    points = config.mqar.eval.points(config.mqar.train)
    assert [(p.num_pairs, p.lead, p.lead_kind) for p in points] == [
        (n, lead, kind) for n in (2, 3) for lead in (0, 16) for kind in ("novel", "repeated")
    ]
    seeds = {(p.lead, p.lead_kind): p.seed for p in points if p.num_pairs == 2}
    assert len(set(seeds.values())) == 4  # each lead length and kind its own rows
    plain = study_from_mapping(MQAR).mqar
    assert plain is not None  # a point without a lead keeps the rows it always had
    assert plain.eval.points(plain.train)[0].seed == derived_seed(0, EVAL, 2, 0, 1, 1)
    argv = ["study", "--config", write(tmp_path / "s.yaml", study), "--out-dir",
            str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs")]  # fmt: skip
    assert main(argv) == 0
    stem = tmp_path / "out" / "study_tiny"
    record = json.loads(stem.with_suffix(".json").read_text())["runs"][0]
    assert [(p["lead"], p["lead_kind"], p["seq_len"]) for p in record["points"][:4]] == [
        (0, "novel", 8), (0, "repeated", 8), (16, "novel", 24), (16, "repeated", 24),
    ]  # fmt: skip
    fates = [p["pair_tokens"] for p in record["points"]]
    assert all(list(f) == ["founded", "merged", "window"] for f in fates)
    assert all(sum(f.values()) == pytest.approx(1.0) for f in fates)
    # chunks of 4, a window of one chunk, a fixed state of the first chunk's 4 slots: without a
    # lead the 2 pairs are that chunk; after a lead of 16 they are tokens 16-19 of 24, merged
    assert fates[0] == {"founded": 1.0, "merged": 0.0, "window": 0.0}
    assert fates[2] == {"founded": 0.0, "merged": 1.0, "window": 0.0}
    md = stem.with_suffix(".md").read_text()
    assert "## Where the pairs' tokens are at the end of the row" in md
    assert "| pairs | gap | filler | value_len | lead | lead kind | tokens |" in md
    assert "| 2 | 0 | random | 1 | 16 | novel | 24 |" in md
    assert "capped at the rest, a novel lead of 32 ids of its own before the pairs" in md
    assert "| variant | seed | lead kind | 0 | 16 | below half at |" in md
    assert stem.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    before = eval_files(tmp_path / "runs")
    monkeypatch.setattr("longkv.study.grid.train", None)  # a finished run is not trained again
    assert main(argv) == 0 and eval_files(tmp_path / "runs") == before


def test_accuracy_by_lead_and_where_it_falls_below_half() -> None:
    def point(lead: int, kind: str, accuracy: float) -> dict[str, Any]:
        return {"lead": lead, "lead_kind": kind, "accuracy": accuracy}

    points = [
        point(0, "novel", 0.8), point(0, "novel", 0.6), point(512, "novel", 0.5),
        point(128, "novel", 0.4), point(128, "novel", 0.2), point(0, "repeated", 0.9),
        point(512, "repeated", 0.5), {"accuracy": 0.1},  # a record without a lead: filler, 0
    ]  # fmt: skip
    novel = by_lead(points, "novel")
    assert list(novel) == [0, 128, 512]  # ascending, whatever the points' order
    assert novel == pytest.approx({0: 0.7, 128: 0.3, 512: 0.5})
    assert below_half(novel, 0.01) == "128"  # 0.3 < 0.35, though 512 recovers
    assert below_half({0: 0.8, 128: 0.5, 512: 0.3, 2048: 0.1}, 0.01) == "512"  # the first below
    assert below_half(by_lead(points, "repeated"), 0.01) == "> 512"  # 0.5 >= 0.45
    assert by_lead(points, "filler") == {0: 0.1}
    assert below_half({128: 0.1}, 0.01) == "-"  # nothing to halve
    # a run at chance with no lead has no fall to find: 0.03 / 2 is below chance's 0.02
    assert below_half({0: 0.03, 128: 0.01}, 0.02) == "at chance"
    assert below_half({0: 0.05, 128: 0.01}, 0.02) == "128"


def bad(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    study = copy.deepcopy(MQAR)
    node = study
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return study


@pytest.mark.parametrize(
    ("study", "message"),
    [
        (bad(("colour",), 1), r"study: unknown keys \['colour'\]"),
        (bad(("variants", "kvm", "mixr"), "kvm"), r"variants\.kvm: unknown keys \['mixr'\]"),
        (bad(("variants", "kvm", "mixer"), "lstm"), r"variant kvm: LongKVConfig\.mixer"),
        (bad(("train", "seed"), 3), r"train\.seed: set from each of seeds"),
        (bad(("train", "stepz"), 3), r"train: unknown keys \['stepz'\]"),
        (bad(("model", "vocab_size"), 99), r"model\.vocab_size: set by mqar\.train\.vocab_size"),
        (bad(("mqar", "train", "seq_len"), 8), r"mqar\.train\.seq_len: 8 cannot hold num_pairs=3"),
        (bad(("mqar", "train", "rows"), 15), r"mqar\.train\.rows: must be a multiple of the 2"),
        (bad(("mqar", "train", "fillers"), ["noise"]), r"mqar\.train\.fillers"),
        (bad(("mqar", "eval", "num_pairs"), [20]), r"mqar\.eval: MQARConfig\.vocab_size"),
        (bad(("mqar", "eval", "max_len"), 12), r"mqar\.eval\.max_len: the point num_pairs=2"),
        (bad(("mqar", "eval", "lead_kinds"), ["novel"]), r"mqar\.eval: MQARConfig\.lead_vocab"),
        (bad(("mqar", "eval", "lead_kinds"), ["noise"]), r"mqar\.eval\.lead_kinds: must be"),
        (bad(("seeds",), [1, 1]), r"seeds: must be a non-empty list of distinct ints"),
        (bad(("task",), "lm"), r"lm: task 'lm' needs a lm section"),
        (bad(("name",), "a/b"), r"name: must be a folder name"),
    ],
)  # fmt: skip
def test_config_errors_name_the_key(study: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        study_from_mapping(study)


def test_the_cli_reports_a_bad_config_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path / "study.yaml", bad(("train", "seed"), 3))
    assert main(["study", "--config", config]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "longkv: error: train.seed: set from each of seeds; remove it"
    config = write(tmp_path / "study.yaml", MQAR)
    assert main(["study", "--config", config, "--only", "gru"]) == 2
    assert "--only: unknown variants ['gru']" in capsys.readouterr().err


def test_the_example_config_parses() -> None:
    study = load_study(EXAMPLE)
    assert study.task == "mqar" and len(study.variants) >= 2


def test_a_tiny_lm_study_reports_loss_by_position(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        with gzip.open(corpus / f"d{i}.txt.gz", "wt") as f:
            f.write(f"The cat sat on the mat number {i}. " * 60)
    study = {
        "name": "lm_tiny", "task": "lm", "seeds": [0], "model": TINY_MODEL,
        "variants": {"full": {"mixer": "full"}, "kvm": None}, "train": TRAIN,
        "lm": {"data": {"folder": str(corpus), "seq_len": 16, "every": 2},
               "eval": {"length": 64, "rows": 2, "batch_size": 2}},
    }  # fmt: skip
    argv = ["study", "--config", write(tmp_path / "lm.yaml", study),
            "--out-dir", str(tmp_path / "out"), "--runs-dir", str(tmp_path / "runs")]  # fmt: skip
    assert main(argv) == 0
    page = json.loads((tmp_path / "out" / "study_lm_tiny.json").read_text())
    buckets = page["mean"]["kvm"]["buckets"]
    assert [(b["low"], b["high"]) for b in buckets] == [
        (0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 64),
    ]  # fmt: skip
    assert all(b["loss"] > 0 for b in buckets)
    record = page["runs"][0]
    assert record["settings"]["data"]["folder"] == str(corpus)
    assert record["settings"]["model"]["vocab_size"] == 50257  # the shipped GPT-2's
    md = (tmp_path / "out" / "study_lm_tiny.md").read_text()
    assert "## Held-out loss by position" in md
    assert (tmp_path / "out" / "study_lm_tiny.png").is_file()
    data = StudyData(study_from_mapping(study))
    held_out = pack_texts(data.tokenizer, split_texts(data.study.lm.data)[1], 64)
    assert len(held_out) > 2 and torch.equal(data.long_rows, held_out[[0, -1]])  # spread out
    with pytest.raises(ValueError, match=r"lm\.eval\.rows: the held-out documents fill"):
        too_many = copy.deepcopy(study)
        too_many["lm"]["eval"]["rows"] = 1000
        run_study(study_from_mapping(too_many), tmp_path / "more")
