"""`longkv bench kvm` end to end on tiny sizes, and the peak-memory probe."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_hf
from longkv.bench import memory
from longkv.bench.compare import compare_methods, step_seconds
from longkv.bench.kvm import METHODS, BenchSettings
from longkv.bench.memory import cpu_peak_supported, load_weights, peak_memory
from longkv.bench.train import TrainBenchSettings
from longkv.cli.main import main


def test_bench_kvm_writes_results_with_provenance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "bench", "kvm", "--lengths", "64", "256", "--heads", "2", "--head-dim", "8",
        "--chunk-len", "16", "--repeats", "1", "--decode-tokens", "4", "--out-dir", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "bench_kvm.json").read_text())
    assert data["provenance"]["command"] == "longkv " + " ".join(argv)
    assert data["provenance"]["commit"]
    assert data["provenance"]["machine"]["torch"] == torch.__version__
    runs = {(m["method"], m["T"]) for m in data["measurements"]}
    assert runs == {(m, T) for m in METHODS for T in (64, 256)}
    for m in data["measurements"]:
        assert m["prefill_s"] > 0 and m["decode_s_per_token"] > 0 and m["state_bytes"] > 0
    assert data["ratios"]["ovq / bswa decode per token at 256"]["target"] == "<= 1.5"
    assert data["ratios"]["ovq state / its bound at 256"]["met"]
    ratio = data["ratios"]["kvm_fixed / bswa prefill at 256"]
    assert ratio["target"] == "<= 2" and ratio["value"] > 0
    assert "kvm_fixed / bswa prefill at 256" in printed
    # each target says the length it holds from and whether it was met
    assert "(target >= 12 from 32768 tokens: not measured at this length)" in printed
    speedup = data["ratios"]["full / kvm_fixed prefill at 256"]
    assert speedup["from"] == 32768 and speedup["met"] is None
    assert ratio["met"] == (ratio["value"] <= 2)
    assert f"(target <= 2: {'met' if ratio['met'] else 'missed'})" in printed
    assert (tmp_path / "bench_kvm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "bench_kvm.md").read_text()
    assert data["provenance"]["command"] in page and data["provenance"]["commit"] in page
    assert "| kvm_fixed / bswa prefill at 256 |" in page
    assert not list(tmp_path.glob("*.tmp*"))


def test_bench_state_sizes_show_bounded_memory(tmp_path: Path) -> None:
    argv = [
        "bench", "kvm", "--lengths", "128", "512", "--heads", "1", "--head-dim", "8",
        "--chunk-len", "16", "--repeats", "1", "--decode-tokens", "1", "--out-dir", str(tmp_path),
        "--methods", "kvm_fixed", "full",
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads((tmp_path / "bench_kvm.json").read_text())
    state = {(m["method"], m["T"]): m["state_bytes"] for m in data["measurements"]}
    assert state[("kvm_fixed", 128)] == state[("kvm_fixed", 512)]
    assert state[("full", 512)] > 3 * state[("full", 128)]


def test_bad_settings_are_reported() -> None:
    with pytest.raises(ValueError, match="methods: unknown"):
        BenchSettings(methods=("kvm_fixed", "mamba"))
    assert main(["bench", "kvm", "--lengths", "0"]) == 2
    with pytest.raises(ValueError, match=r"BenchSettings\.lengths: must be >= 1, got 64 0"):
        BenchSettings(lengths=(64, 0))
    with pytest.raises(ValueError, match=r"BenchSettings\.head_dim: must be >= 4, got 2"):
        BenchSettings(head_dim=2)
    assert main(["bench", "train", "--threads", "0"]) == 2
    with pytest.raises(ValueError, match=r"BenchSettings\.threads: must be >= 1, got 0"):
        BenchSettings(threads=0)
    with pytest.raises(
        ValueError, match=r"TrainBenchSettings\.variants: unknown rnn; choose from kvm_fixed"
    ):
        TrainBenchSettings(variants=("full", "rnn"))
    with pytest.raises(ValueError, match=r"TrainBenchSettings\.repeats: must be >= 1"):
        TrainBenchSettings(repeats=0)


@pytest.mark.skipif(not cpu_peak_supported(), reason="needs Linux /proc/self/clear_refs")
def test_peak_memory_sees_a_temporary_allocation() -> None:
    def allocate() -> int:
        x = torch.ones(50_000_000)  # 200 MB, freed before returning
        return int(x[0])

    result, peak = peak_memory(allocate, torch.device("cpu"))
    assert result == 1
    assert peak is not None and 150e6 < peak < 400e6
    _, small = peak_memory(lambda: None, torch.device("cpu"))
    assert small is not None and small < 50e6


@pytest.mark.skipif(not cpu_peak_supported(), reason="needs Linux /proc/self/clear_refs")
def test_peak_memory_counts_what_the_call_keeps_when_the_resident_set_does_not_rise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under memory pressure the kernel reclaims pages while the call runs, and the resident
    set may end no higher than it began: the live heap bytes still see what the call kept."""
    kept: list[torch.Tensor] = []

    def allocate() -> None:
        kept.append(torch.ones(4_000_000))  # 16 MB, kept

    monkeypatch.setattr(memory, "status_bytes", lambda key: 2**30)  # resident: flat
    _, peak = peak_memory(allocate, torch.device("cpu"))
    assert peak is not None and 15e6 < peak < 20e6
    monkeypatch.setattr(memory, "_live_heap_bytes", lambda: None)  # no mallinfo2: resident only
    _, peak = peak_memory(allocate, torch.device("cpu"))
    assert peak == 0


@pytest.mark.skipif(not cpu_peak_supported(), reason="needs Linux /proc/self/clear_refs")
def test_peak_memory_is_not_hidden_by_garbage_collected_during_the_call() -> None:
    """Memory held by a reference cycle from before the call is freed before it, not inside it
    (where a collection would lower the resident set by more than the call adds)."""

    class Cycle:
        def __init__(self) -> None:
            self.me, self.held = self, torch.ones(25_000_000)  # 100 MB

    def allocate() -> int:
        [[] for _ in range(10_000)]  # enough allocations for a collection to start
        x = torch.ones(5_000_000)  # 20 MB
        return int(x[0])

    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(5_000)  # not before the call, but inside it
    Cycle()
    try:
        _, peak = peak_memory(allocate, torch.device("cpu"))
    finally:
        gc.set_threshold(*thresholds)
    assert peak is not None and 15e6 < peak < 60e6
    assert gc.isenabled()


@pytest.mark.skipif(not cpu_peak_supported(), reason="needs Linux /proc/self/clear_refs")
def test_compared_peaks_exclude_weights_mapped_lazily(tmp_path: Path) -> None:
    """A freshly loaded model's weights are paged in on first use: not the forward's memory."""
    tiny_hf(
        vocab_size=50_000, hidden_size=256, num_hidden_layers=1, tie_word_embeddings=False
    ).save_pretrained(tmp_path)  # lm_head alone: 51 MB
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 50_000, (1, 6))
    report = compare_methods(model, ids, 3, methods=("full", "fold"))
    peaks = {r["method"]: r["peak_memory_bytes"] for r in report["runs"]}
    assert peaks["full"] < 20e6 and peaks["fold"] < 20e6, peaks


@pytest.mark.skipif(not cpu_peak_supported(), reason="needs Linux /proc/self/clear_refs")
def test_reading_weights_in_allocates_nothing_their_size() -> None:
    """int8 weights (`longkv.models.int8`) and masks are read in place, not widened."""
    module = torch.nn.Module()
    module.register_buffer("q", torch.ones(40_000_000, dtype=torch.int8))
    module.register_buffer("mask", torch.ones(40_000_000, dtype=torch.bool))
    _, peak = peak_memory(lambda: load_weights(module), torch.device("cpu"))
    assert peak is not None and peak < 8e6, peak


def test_flop_counts_follow_the_states_a_run_goes_through() -> None:
    """kvm_work's pairs and similarities, counted again from the slots a token-by-token run
    holds: each query sees the slots (from chunk N on) and its window; each update that
    merges compares the block with the slots before it and the ones it founds."""
    from conftest import make_inputs
    from longkv.bench.flops import Shape, kvm_work, window_work
    from longkv.kvm import KVMConfig, kvm_attention

    C, N, T, n_dec = 4, 2, 37, 5
    config = KVMConfig(
        chunk_len=C, window_chunks=N, budget="power_law", state_min_len=4, growth_factor=3.0,
        max_state_chunks=None,
    )  # fmt: skip
    inp = make_inputs(T=T + n_dec, Dk=8, Dv=8)
    pairs, sims, state, slots_before = [0.0, 0.0], [0.0, 0.0], None, 0
    for p in range(T + n_dec):
        q, k, v, extras = inp.span(p, p + 1)
        _, state = kvm_attention(q, k, v, config, state=state, **extras)
        c, lo = p // C, max(0, (p // C - N + 1) * C)
        if p % C == 0 and c > N:  # the block c - N left the window at this token
            founded = state.num_slots - slots_before
            sims[p >= T] += C * state.num_slots if founded < C else 0
        slots_before = state.num_slots
        pairs[p >= T] += (state.num_slots if c >= N else 0) + p - lo + 1
    shape = Shape(B=2, H=4, Hkv=2, D=8)
    work = kvm_work(config, T, n_dec, shape)
    assert work.prefill_flops == shape.attention(pairs[0]) + shape.similarity(sims[0])
    assert work.decode_flops == (shape.attention(pairs[1]) + shape.similarity(sims[1])) / n_dec
    full = window_work(lambda p: 0, T, n_dec, shape)
    assert full.prefill_flops == shape.attention(T * (T + 1) / 2)


def test_ovq_flop_counts_follow_the_dictionary_a_run_holds() -> None:
    """ovq_work's pairs and similarities, counted again from a token-by-token run: each query
    sees the centroids visible in its chunk and its chunk up to itself; each complete chunk is
    compared with the centroids before it (the first chunk with its first token)."""
    from longkv.bench.flops import Shape, ovq_work
    from longkv.ovq import OVQConfig, ovq_attention

    config, T, n_dec = OVQConfig(chunk_len=4, max_centroids=6), 29, 7
    q, k, v = torch.randn(3, 1, 2, T + n_dec, 8, generator=torch.Generator().manual_seed(0))
    pairs, sims, state = [0.0, 0.0], [0.0, 0.0], None
    for p in range(T + n_dec):
        visible = 0 if state is None else state.visible
        _, state = ovq_attention(q[..., p : p + 1, :], k[..., p : p + 1, :], v[..., p : p + 1, :],
                                 config, state=state)  # fmt: skip
        pairs[p >= T] += visible + p % 4 + 1
        if state.seen % 4 == 0:
            sims[p >= T] += 4 * max(visible, 1)
    shape = Shape(B=1, H=2, Hkv=2, D=8)
    work = ovq_work(config, T, n_dec, shape)
    assert work.prefill_flops == shape.attention(pairs[0]) + shape.similarity(sims[0])
    assert work.decode_flops == (shape.attention(pairs[1]) + shape.similarity(sims[1])) / n_dec
    assert sims[0] and sims[1]  # the decode completes a chunk


def test_compared_runs_report_what_each_query_attends_and_the_bytes_each_cache_holds() -> None:
    from longkv.caches import KVMFoldConfig
    from longkv.caches.bounded import BoundedConfig

    model = tiny_hf()
    ids = torch.randint(0, 64, (1, 90), generator=torch.Generator().manual_seed(3))
    two_level = dict(budget=26, sinks=2, window=16, open=8)
    bounded = {
        "streaming": BoundedConfig(budget=26, sinks=2, window=24),
        "open": KVMFoldConfig(**two_level),
        "file": KVMFoldConfig(**two_level, leaves="file"),
    }
    report = compare_methods(model, ids, 90, methods=("full", *bounded), bounded=bounded,
                             stream_chunk=8)  # fmt: skip
    runs = {r["method"]: r for r in report["runs"]}
    c = model.config
    heads = c.num_hidden_layers * c.num_key_value_heads  # over layers
    per_token = heads * 2 * 4 * c.hidden_size // c.num_attention_heads  # keys, values: float32
    owners = heads * 8  # an int64 owner per leaf
    assert runs["full"]["cache_bytes"] == 90 * per_token and runs["full"]["attended_share"] == 1
    # the last chunk (tokens 88, 89) after 24 entries: (25 / 89 + 26 / 90) / 2
    assert runs["streaming"]["attended_share"] == pytest.approx((25 / 89 + 26 / 90) / 2)
    assert (
        runs["streaming"]["cache_bytes"] == 26 * per_token and runs["streaming"]["leaf_bytes"] == 0
    )
    for name in ("open", "file"):  # every slot open: what full attention attends
        assert runs[name]["attended_share"] == runs[name]["attended_share_max"] == 1.0
    leaf_rows = 90 - 2 - 16  # every token but the sinks and the window (chunk included)
    assert runs["open"]["leaf_bytes"] == leaf_rows * (per_token + owners)
    assert runs["file"]["leaf_file_bytes"] == leaf_rows * per_token
    assert runs["file"]["leaf_bytes"] == leaf_rows * owners  # in memory: the owners only
    assert runs["open"]["nll_gap_vs_full"] == pytest.approx(0.0, abs=1e-5)


def test_compare_times_decoding_steps_after_each_read_and_refuses_steps_past_the_input() -> None:
    """A decoding step per method, timed at the input's length after its runs (in rounds),
    with its ratio to full attention's; steps must leave tokens to read first."""
    from longkv.caches import KVMFoldConfig
    from longkv.caches.quest import QuestConfig

    model = tiny_hf()
    ids = torch.randint(0, 64, (1, 60), generator=torch.Generator().manual_seed(3))
    bounded = {
        "two-level": KVMFoldConfig(budget=26, sinks=2, window=16, open=2),
        "quest": QuestConfig(budget=26, sinks=2, window=16, page=4, open=2),
    }
    report = compare_methods(model, ids, 60, methods=("full", "fold", *bounded), bounded=bounded,
                             stream_chunk=8, repeats=2, decode_tokens=3)  # fmt: skip
    runs = {r["method"]: r for r in report["runs"]}
    assert all(r["decode_seconds"] > 0 and r["seconds"] > 0 for r in runs.values())
    assert set(report["ratios"]) >= {f"{m} / full decoding step" for m in ("fold", *bounded)}
    assert compare_methods(model, ids, 60)["runs"][0]["decode_seconds"] is None
    with pytest.raises(ValueError, match=r"decode_tokens: must lie in \[0, 60\)"):
        compare_methods(model, ids, 60, decode_tokens=60)


def test_decoding_steps_take_turns():
    """Every method steps through the same tokens in order, the methods taking each token in
    turn, so that a machine slowing down weighs on all of them alike."""
    fed: list[tuple[str, int]] = []

    def stepper(name: str):
        return lambda ids: fed.append((name, int(ids.item())))

    ids = torch.tensor([[5, 6, 7]])
    seconds = step_seconds({"full": stepper("full"), "quest": stepper("quest")}, ids)
    assert set(seconds) == {"full", "quest"} and all(s >= 0 for s in seconds.values())
    assert fed == [("full", 5), ("quest", 5), ("full", 6), ("quest", 6), ("full", 7), ("quest", 7)]


def test_a_benchmark_never_replaces_another_runs_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bench_kvm.json").write_text(json.dumps({"settings": {"lengths": [1]}}))
    assert main(["bench", "kvm", "--lengths", "64", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "argument --name: " in err and "bench_kvm.json holds a run of other settings" in err
