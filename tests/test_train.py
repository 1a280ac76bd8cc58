"""The training loop: exact resume and extension, refused checkpoints, progress, torchrun ranks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import assert_same_training, loss_and_grads
from longkv.models import LongKVConfig, LongKVForCausalLM
from longkv.train.checkpoint import CHECKPOINT
from longkv.train.config import TrainConfig, lr_factor
from longkv.train.loop import batch_rows, train
from longkv.train.rows import LabelledRows, evaluate

HELPER = Path(__file__).parent / "helpers" / "ddp_train.py"
CONFIG = LongKVConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, mixer="kvm",
    kvm=dict(chunk_len=4, window_chunks=2, state_min_len=4, rope_dim=4),
)  # fmt: skip
ROWS = (torch.arange(64)[:, None] * 5 + torch.arange(17)[None]) % 64  # learnable: counting
CFG = TrainConfig(  # fp32: the loop's arithmetic compared exactly
    steps=6, batch_size=8, warmup=2, eval_every=3, checkpoint_every=1, precision="fp32"
)


def untimed(metrics: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in row.items() if k != "seconds"} for row in metrics]


def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(tmp_path: Path) -> None:
    whole = train(CONFIG, CFG, ROWS, ROWS[:16], tmp_path / "a")
    first = train(CONFIG, CFG, ROWS, ROWS[:16], tmp_path / "b", stop_after=3)
    assert len(first) == 3
    resumed = train(CONFIG, CFG, ROWS, ROWS[:16], tmp_path / "b")
    assert untimed(resumed) == untimed(whole)
    assert [row["seconds"] for row in resumed[:3]] == [row["seconds"] for row in first]
    assert resumed[3]["seconds"] > resumed[2]["seconds"]  # the clock continues after resume
    assert whole[-1]["loss"] < whole[0]["loss"]  # it learns
    assert (tmp_path / "b" / "metrics.csv").read_text().count("\n") == 7


def test_bf16_parameters_train_float32_master_weights_and_resume_exactly(tmp_path: Path) -> None:
    """precision bf16: the checkpointed weights are float32 and take updates too small for
    bfloat16 (lr 1e-5 moves no weight by a bf16 step), a resumed run equals an uninterrupted
    one, and the losses follow float32 training's."""
    cfg = replace(CFG, precision="bf16")
    whole = train(CONFIG, cfg, ROWS, ROWS[:16], tmp_path / "a")
    train(CONFIG, cfg, ROWS, ROWS[:16], tmp_path / "b", stop_after=3)
    assert untimed(train(CONFIG, cfg, ROWS, ROWS[:16], tmp_path / "b")) == untimed(whole)
    fp32 = train(CONFIG, CFG, ROWS, ROWS[:16], tmp_path / "c")
    assert all(abs(a["loss"] - b["loss"]) < 0.05 for a, b in zip(whole, fp32, strict=True))
    slow = replace(cfg, steps=1, warmup=0, lr=1e-5, weight_decay=0.0)
    train(CONFIG, slow, ROWS, ROWS[:16], tmp_path / "d")
    torch.manual_seed(slow.seed)
    start = LongKVForCausalLM(CONFIG).state_dict()
    trained = torch.load(tmp_path / "d" / CHECKPOINT, weights_only=False)["model"]
    assert all(trained[name].dtype == torch.float32 for name in start)
    after, before = (torch.cat([w[n].flatten() for n in start]) for w in (trained, start))
    moved = after != before
    unseen_in_bf16 = after.bfloat16() == before.bfloat16()
    assert moved.float().mean() > 0.9  # Adam moves nearly every weight by about lr
    assert (moved & unseen_in_bf16).sum() > moved.sum() / 2  # mostly below bf16's spacing


def test_a_run_whose_rows_fit_the_kvm_window_resumes_exactly(tmp_path: Path) -> None:
    rows = ROWS[:, :9]  # seq_len 8 = chunk_len * window_chunks: no merge, the gates get no grad
    whole = train(CONFIG, CFG, rows, rows[:16], tmp_path / "a")
    train(CONFIG, CFG, rows, rows[:16], tmp_path / "b", stop_after=3)
    assert untimed(train(CONFIG, CFG, rows, rows[:16], tmp_path / "b")) == untimed(whole)
    a, b = (torch.load(tmp_path / r / CHECKPOINT, weights_only=False) for r in "ab")
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    assert "blocks.0.mixer.gate_proj.weight" not in a["optimizer"]["state"]  # never trained
    for name, state in a["optimizer"]["state"].items():  # the same AdamW state, exactly
        assert all(torch.equal(v, b["optimizer"]["state"][name][k]) for k, v in state.items())
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())


def test_a_finished_run_extends_to_more_steps_on_the_new_schedule(tmp_path: Path) -> None:
    six = train(CONFIG, CFG, ROWS, ROWS[:16], tmp_path / "a")
    longer = replace(CFG, steps=9, eval_every=4, checkpoint_every=2)  # and other bookkeeping
    extended = train(CONFIG, longer, ROWS, ROWS[:16], tmp_path / "a")
    nine = train(CONFIG, longer, ROWS, ROWS[:16], tmp_path / "b")
    assert extended[:6] == six  # the finished steps stay as they were
    lrs = [CFG.lr * lr_factor(s, CFG.warmup, 9) for s in range(6, 9)]
    assert [r["lr"] for r in extended[6:]] == [r["lr"] for r in nine[6:]] == lrs
    assert six[-1]["lr"] == CFG.lr * lr_factor(5, CFG.warmup, 6) != nine[5]["lr"]
    # not the 9-step run: its first six steps followed the 9-step decay, not the 6-step one
    assert all(e["loss"] != n["loss"] for e, n in zip(extended[6:], nine[6:], strict=True))
    assert [r["step"] for r in extended if "eval_loss" in r] == [3, 6, 8, 9]
    assert torch.load(tmp_path / "a" / CHECKPOINT, weights_only=False)["step"] == 9


def test_mismatched_or_corrupt_checkpoints_are_refused_untouched(tmp_path: Path) -> None:
    data: dict[str, Any] = {"seq_len": 16, "every": 20}
    train(CONFIG, CFG, ROWS, ROWS[:16], tmp_path, data=data, stop_after=2)
    before = (tmp_path / CHECKPOINT).read_bytes()
    other = replace(CFG, lr=5e-4, seed=1, steps=8)  # steps may change, the others not
    refused = r"train\.lr: 0\.001 -> 0\.0005; train\.seed: 0 -> 1\);"
    with pytest.raises(ValueError, match=refused):
        train(CONFIG, other, ROWS, ROWS[:16], tmp_path, data=data)
    with pytest.raises(ValueError, match=r"\(data\.seq_len: 16 -> 32\)"):
        train(CONFIG, CFG, ROWS, ROWS[:16], tmp_path, data={**data, "seq_len": 32})
    bigger = LongKVConfig(**{**CONFIG.to_dict(), "d_model": 64})
    with pytest.raises(ValueError, match=r"\(model\.d_model: 32 -> 64\)"):
        train(bigger, CFG, ROWS, ROWS[:16], tmp_path, data=data)
    with pytest.raises(ValueError, match=r"at step 2, past train\.steps=1; pass train\.steps >= 2"):
        train(CONFIG, replace(CFG, steps=1), ROWS, ROWS[:16], tmp_path, data=data)
    assert (tmp_path / CHECKPOINT).read_bytes() == before
    (tmp_path / CHECKPOINT).write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is unreadable"):
        train(CONFIG, CFG, ROWS, ROWS[:16], tmp_path)
    assert (tmp_path / CHECKPOINT).read_bytes() == b"not a checkpoint"


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_torchrun_ranks_give_the_losses_of_one_process(tmp_path: Path, parallel: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def losses(n: int, run: str, seq_len: int, *stop_after: str) -> list[list[float]]:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
            str(HELPER), str(tmp_path / run), parallel, str(seq_len), *stop_after,
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    [one], [two, resumed] = losses(1, "one", 16), losses(2, "two", 16, "2")
    assert len(one) == len(two) == 6  # 4 training losses, then the eval losses of steps 2 and 4
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) <= 1e-5
    assert (tmp_path / "two" / "model" / "model.safetensors").is_file()
    assert resumed == two  # an interrupted run resumes from its gathered checkpoint exactly
    # rows that fit the KVM window: the merge gates never get a gradient, nor AdamW state
    short, short_resumed = losses(2, "short", 8, "2")
    assert len(short) == 6 and short_resumed == short


def test_the_progress_bar_shows_the_losses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = train(CONFIG, CFG, ROWS, ROWS[:16], tmp_path, desc="kvm seed 1")
    bar = capsys.readouterr().err
    assert bar.count("kvm seed 1: ") >= 6  # the caller's label on every update
    assert f"loss={metrics[0]['loss']:.4f}]" in bar  # before the first eval: the loss alone
    shown = f"loss={metrics[-1]['loss']:.4f}, eval_loss={metrics[-1]['eval_loss']:.4f}]"
    assert re.search(r"6/6 \[[^]]*" + re.escape(shown), bar)  # the finished bar


def test_held_out_rows_short_of_a_batch_are_refused_before_the_first_step(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"held-out rows: 3 do not fill one batch of 4.*train\.batch_size="
    ):
        train(CONFIG, replace(CFG, batch_size=4), ROWS, ROWS[:3], tmp_path / "a")
    assert not (tmp_path / "a").exists()  # nothing trained, nothing written


def test_schedule_and_batches() -> None:
    assert [round(lr_factor(s, 2, 6), 3) for s in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    a, b = batch_rows(0, 64, 8, 0), batch_rows(8, 64, 8, 0)  # step 8 starts epoch 1
    assert len(set(a.tolist())) == 8 and not torch.equal(a, b)
    epoch = torch.cat([batch_rows(s, 64, 8, 0) for s in range(8)])
    assert sorted(epoch.tolist()) == list(range(64))
    with pytest.raises(ValueError, match=r"TrainConfig\.steps: must be >= 1"):
        TrainConfig(steps=0)


def test_tensorboard_gets_every_metric_across_a_resume(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(CONFIG, CFG, ROWS, ROWS[:16], tmp_path, stop_after=2)
    at_step_2 = (tmp_path / CHECKPOINT).read_bytes()
    train(CONFIG, CFG, ROWS, ROWS[:16], tmp_path, stop_after=4)
    (tmp_path / CHECKPOINT).write_bytes(at_step_2)  # a crash after logging steps 3 and 4
    metrics = train(CONFIG, CFG, ROWS, ROWS[:16], tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for key in ("loss", "lr", "eval_loss"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        expected = [(m["step"], m[key]) for m in metrics if key in m]
        assert [s for s, _ in logged] == [s for s, _ in expected]  # replayed steps once
        assert max(abs(a - b) for (_, a), (_, b) in zip(logged, expected, strict=True)) < 1e-6


def test_labelled_rows_score_exactly_their_labelled_tokens(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = LongKVForCausalLM(CONFIG).eval()
    labels = torch.full_like(ROWS[:8], -100)
    labels[:, 5], labels[:3, 16] = 7, ROWS[:3, 16]  # 8 + 3 scored targets
    loss = evaluate(model, LabelledRows(ROWS[:8], labels), 1, 8)
    with torch.no_grad():
        logp = model(ROWS[:8, :-1]).logits.log_softmax(-1)  # position t predicts t + 1
    by_hand = -(logp[:, 4, 7].sum() + logp[torch.arange(3), 15, ROWS[:3, 16]].sum()) / 11
    assert abs(loss - by_hand.item()) < 1e-6
    plain = evaluate(model, ROWS[:8], 1, 8)  # token rows: every next token
    every = -logp.gather(-1, ROWS[:8, 1:, None]).mean()
    assert abs(plain - every.item()) < 1e-6
    assert plain == evaluate(model, LabelledRows(ROWS[:8], ROWS[:8]), 1, 8)
    rows = LabelledRows(ROWS, labels.repeat(8, 1))
    first = train(CONFIG, replace(CFG, steps=1), rows, rows[:16], tmp_path)[0]["loss"]
    torch.manual_seed(CFG.seed)  # the trainer's initial model
    initial = LongKVForCausalLM(CONFIG)
    assert abs(first - evaluate(initial, rows[batch_rows(0, 64, 8, CFG.seed)], 1, 8)) < 1e-6


def test_the_kvm_paper_recipe_sets_each_groups_lr_and_decay_as_the_spec_does() -> None:
    """spec training.md 1.6 at 120M (rho = 768 / 768) and 350M (rho = 1024 / 768): AdamW
    (0.9, 0.95), no clipping, warmup 200 then linear decay to 0; matrices lr0 / rho and
    wd0 * rho, the embedding lr0 and wd0, scalars (norms, temperatures, shifts) no decay; the
    decay scaled by lr_t / lr_peak."""
    from longkv.train.config import param_groups, schedule

    cfg = TrainConfig.from_section({"recipe": "kvm_paper", "steps": 6000})
    assert (cfg.betas, cfg.grad_clip, cfg.warmup, cfg.lr, cfg.weight_decay) == (
        (0.9, 0.95),
        None,
        200,
        2e-3,
        0.2,
    )
    model = LongKVForCausalLM(CONFIG)
    for d_model, rho in ((768, 1.0), (1024, 1024 / 768)):
        groups = {g["name"]: g for g in param_groups(model, cfg, d_model)}
        in_groups = sorted(id(p) for g in groups.values() for p in g["params"])
        assert in_groups == sorted(id(p) for p in model.parameters())  # each in exactly one
        assert groups["embedding"]["params"] == [model.get_input_embeddings().weight]
        assert all(p.dim() == 1 for p in groups["scalars"]["params"])
        norms = [m.weight for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
        assert {id(p) for p in norms} <= {id(p) for p in groups["scalars"]["params"]}
        for step, factor in ((0, 1 / 200), (199, 1.0), (200, 1.0), (3100, 0.5), (5999, 1 / 5800)):
            lr = schedule(list(groups.values()), cfg, step)
            assert lr == pytest.approx(2e-3 * factor, rel=1e-12)
            want = {"matrices": (2e-3 / rho, 0.2 * rho), "embedding": (2e-3, 0.2),
                    "scalars": (2e-3, 0.0)}  # fmt: skip
            for name, (lr0, wd0) in want.items():
                assert groups[name]["lr"] == pytest.approx(lr0 * factor, rel=1e-12), (name, step)
                assert groups[name]["weight_decay"] == pytest.approx(wd0 * factor, rel=1e-12)


def test_the_default_recipe_decays_every_parameter_and_a_bad_recipe_is_refused() -> None:
    from longkv.train.config import param_groups, schedule

    groups = param_groups(LongKVForCausalLM(CONFIG), CFG, 32)
    schedule(groups, CFG, 4)
    assert {g["weight_decay"] for g in groups} == {CFG.weight_decay}
    assert {g["lr"] for g in groups} == {CFG.lr * lr_factor(4, CFG.warmup, CFG.steps)}
    with pytest.raises(ValueError, match=r"train\.recipe: unknown adam; choose from"):
        TrainConfig.from_section({"recipe": "adam"})
    with pytest.raises(ValueError, match=r"TrainConfig\.grad_clip: must be > 0 \(or null"):
        TrainConfig(grad_clip=0.0)


def test_training_with_checkpointed_blocks_gives_the_same_run(tmp_path: Path) -> None:
    plain = train(CONFIG, CFG, ROWS, ROWS[:16], tmp_path / "a")
    checkpointed = train(CONFIG, replace(CFG, checkpointing=True), ROWS, ROWS[:16], tmp_path / "b")
    assert untimed(checkpointed) == untimed(plain)


def test_compiled_feed_forward_halves_give_eager_loss_and_gradients() -> None:
    """CPU inductor: the loss and every gradient of a tiny KVM model within 1e-5."""
    from longkv.train.loop import compile_feedforward

    ids = (torch.arange(2)[:, None] * 7 + torch.arange(33)[None]) % 64

    def run(compiled: bool) -> tuple[float, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = LongKVForCausalLM(CONFIG).train()
        if compiled:
            compile_feedforward(model)
        return loss_and_grads(model, ids)

    assert_same_training(run(False), run(True), 1e-5)
