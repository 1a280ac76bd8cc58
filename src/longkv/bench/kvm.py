"""`longkv bench kvm`: prefill and decode cost of KVM and OVQ against BSWA and full attention.

Every method runs on the same random q, k, v in one process, so the printed ratios compare
numbers measured side by side. Times are medians over rounds that time every method in turn
(after warm-up calls), so that a drift of the machine touches every method alike; decode
time is the mean over `decode_tokens` single-token calls after a prefill of T tokens (one
chunk's worth by default, so KVM's once-per-chunk state update is included at its real rate),
each passing the state back with donate=True as a decode loop does, its median over one decode
from the state of each timed prefill. Beside each time stands its
floor (`longkv.bench.flops`): the matmul FLOPs the method needs over the rate of the same
machine on matmuls of the same shapes, measured in the same run.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from longkv.attention import block_sliding_window_attention, full_attention
from longkv.bench import check_threads, threads_setting, use_threads
from longkv.bench.flops import Shape, Work, gemm_rate, kvm_work, ovq_work, window_work
from longkv.bench.memory import keep_freed_heap, peak_memory
from longkv.checks import require, require_at_least, require_known, setting
from longkv.dtypes import DTYPES
from longkv.kvm import KVMConfig, kvm_attention
from longkv.ovq import OVQConfig, ovq_attention
from longkv.results import (
    OUT_DIR,
    OUT_DIR_HELP,
    provenance,
)

# The floor's matmul rate is measured for a chunk of queries against the mean keys a query
# sees, at most this many: torch's fused attention kernel computes in blocks of <= 512 keys.
KV_BLOCK = 512
METHODS = ("kvm_fixed", "kvm_sqrt", "kvm_saturation", "ovq", "bswa", "full")
Step = Callable[[Tensor, Tensor, Tensor, Any, bool], tuple[Tensor, Any]]


@dataclass(frozen=True)
class BenchSettings:
    """What `longkv bench kvm` measures (defaults: issue 2's protocol)."""

    lengths: tuple[int, ...] = setting((2048, 8192, 32768), "context lengths T")
    batch: int = setting(1, "batch size B")
    heads: int = setting(4, "attention heads H")
    head_dim: int = setting(64, "head dimension D")
    chunk_len: int = setting(256, "KVM, OVQ and BSWA chunk length C")
    window_chunks: int = setting(2, "chunks in the local window N")
    dtype: str = setting("fp32", "dtype of q, k, v", choices=sorted(DTYPES))
    device: str = setting("cpu", "torch device, e.g. cuda")
    repeats: int = setting(5, "timed prefill calls (median)")
    decode_tokens: int | None = setting(
        None, "single-token decode calls timed (default: as many as the chunk length)"
    )
    methods: tuple[str, ...] = setting(METHODS, "methods measured", choices=METHODS)
    threads: int | None = threads_setting()
    seed: int = setting(0, "seed of the random q, k, v")
    keep_heap: bool = setting(
        True,
        "keep freed memory in the process for reuse (glibc); without it glibc returns freed "
        "memory to the OS and timings include page faults (see memory.keep_freed_heap)",
    )
    out_dir: str = setting(OUT_DIR, OUT_DIR_HELP)
    name: str = setting("bench_kvm", "file name stem of the results")

    def __post_init__(self) -> None:
        require_known(self, "methods", self.methods, sorted(METHODS))
        require(
            self.dtype in DTYPES,
            self,
            "dtype",
            f"must be one of {sorted(DTYPES)}, got {self.dtype!r}",
        )
        require_at_least(1, self, "lengths", "repeats", "batch", "heads")
        check_threads(self)
        require_at_least(4, self, "head_dim")

    @property
    def shape(self) -> Shape:
        """The attention's sizes (every query head has its own key head here)."""
        return Shape(B=self.batch, H=self.heads, Hkv=self.heads, D=self.head_dim)

    @property
    def n_decode(self) -> int:
        """Single-token decode calls timed at each context length."""
        return self.chunk_len if self.decode_tokens is None else self.decode_tokens


def kvm_configs(s: BenchSettings) -> dict[str, KVMConfig]:
    """The KVM methods' configs: the paper's budgets with this run's blocks."""
    blocks = dict(chunk_len=s.chunk_len, window_chunks=s.window_chunks, rope_dim=s.head_dim // 2)
    return {
        "kvm_fixed": KVMConfig.paper_fixed(**blocks),
        "kvm_sqrt": KVMConfig.paper_sqrt(**blocks),
        "kvm_saturation": KVMConfig.paper_saturation(**blocks),
    }


def ovq_config(s: BenchSettings) -> OVQConfig:
    """The OVQ method's config: the paper's (M = 1024 centroids, saturating) with this run's C."""
    return OVQConfig.paper(chunk_len=s.chunk_len)


def kvm_step(config: KVMConfig) -> Step:
    return lambda q, k, v, state, donate: kvm_attention(q, k, v, config, state=state, donate=donate)


def method_steps(s: BenchSettings) -> dict[str, Step]:
    """One call of each method: (q, k, v, state, donate) -> (out, state)."""
    ovq = ovq_config(s)
    return {
        **{name: kvm_step(config) for name, config in kvm_configs(s).items()},
        "ovq": lambda q, k, v, state, donate: ovq_attention(
            q, k, v, ovq, state=state, donate=donate
        ),
        "bswa": lambda q, k, v, state, donate: block_sliding_window_attention(
            q, k, v, s.chunk_len, s.window_chunks, state=state, donate=donate
        ),
        "full": lambda q, k, v, state, donate: full_attention(q, k, v, state=state, donate=donate),
    }


def method_work(s: BenchSettings, method: str, T: int) -> Work:
    """The matmul work of a method's prefill of T tokens and its decode steps."""
    if method in kvm_configs(s):
        return kvm_work(kvm_configs(s)[method], T, s.n_decode, s.shape)
    if method == "ovq":
        return ovq_work(ovq_config(s), T, s.n_decode, s.shape)
    C, N = s.chunk_len, s.window_chunks
    lo = (lambda p: (p // C - N + 1) * C) if method == "bswa" else (lambda p: 0)
    return window_work(lo, T, s.n_decode, s.shape)


@dataclass
class Measurement:
    """One method at one context length."""

    method: str
    T: int
    prefill_s: float
    prefill_peak_bytes: int | None
    decode_s_per_token: float
    state_bytes: int
    prefill_flops: float  # matmul FLOPs the prefill needs (`longkv.bench.flops`)
    prefill_rate: float  # FLOP/s of this machine's matmuls of the prefill's shapes
    decode_flops: float  # per token
    decode_rate: float

    @property
    def prefill_floor_s(self) -> float:
        """The prefill's FLOPs at the measured matmul rate."""
        return self.prefill_flops / self.prefill_rate

    @property
    def decode_floor_s(self) -> float:
        return self.decode_flops / self.decode_rate


@dataclass
class BenchResult:
    settings: BenchSettings
    measurements: list[Measurement] = field(default_factory=list)
    ratios: dict[str, dict[str, Any]] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)

    def get(self, method: str, T: int) -> Measurement:
        return next(m for m in self.measurements if m.method == method and m.T == T)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - t0


def measure(steps: dict[str, Step], T: int, s: BenchSettings) -> list[Measurement]:
    """Every method at context T: the first prefill measures peak memory, a second warms up;
    then `repeats` rounds each time one prefill of every method in turn, and as many rounds each
    decoding from one of those prefills' states, so that a slow drift of the machine touches
    every method alike."""
    device, dtype = torch.device(s.device), DTYPES[s.dtype]
    g = torch.Generator(device=device).manual_seed(s.seed)
    n = T + s.n_decode
    size = (s.batch, s.heads, n, s.head_dim)
    q, k, v = (torch.randn(size, generator=g, device=device, dtype=dtype) for _ in range(3))
    prefill = (q[:, :, :T], k[:, :, :T], v[:, :, :T], None, False)

    def decode(step: Step, st: Any) -> Any:
        for t in range(T, n):
            one = (q[:, :, t : t + 1], k[:, :, t : t + 1], v[:, :, t : t + 1])
            _, st = step(*one, st, True)
        return st

    peaks, prefills, decodes = {}, defaultdict(list), defaultdict(list)
    with torch.no_grad():
        for method, step in steps.items():
            (_, state), peaks[method] = peak_memory(lambda step=step: step(*prefill), device)
            decode(step, state)  # warm-up of the decode, from the first prefill
            step(*prefill)  # warm-up of the prefill, with the heap as the timed calls find it
        for _ in range(s.repeats):
            for method, step in steps.items():
                prefills[method].append(_timed(lambda step=step: step(*prefill), device))
        for r in range(s.repeats):
            for method, step in steps.items():
                (_, st), _ = prefills[method][r]
                decodes[method].append(_timed(lambda step=step, st=st: decode(step, st), device))
    out = []
    for method in steps:
        work = method_work(s, method, T)
        out.append(
            Measurement(
                method=method,
                T=T,
                prefill_s=statistics.median(t for _, t in prefills[method]),
                prefill_peak_bytes=peaks[method],
                decode_s_per_token=statistics.median(t for _, t in decodes[method]) / s.n_decode,
                state_bytes=decodes[method][-1][0].nbytes,
                prefill_flops=work.prefill_flops,
                prefill_rate=gemm_rate(
                    s.shape, s.chunk_len, min(work.prefill_keys, KV_BLOCK), device, dtype, s.repeats
                ),
                decode_flops=work.decode_flops,
                decode_rate=gemm_rate(
                    s.shape, 1, min(work.decode_keys, KV_BLOCK), device, dtype, 10 * s.repeats
                ),
            )
        )
    return out


# time / floor targets of the KVM (issue 11) and OVQ (issue 25) prefills, from this length on
FLOOR_TARGETS = {
    "kvm_fixed": (8192, 1.3), "kvm_sqrt": (32768, 1.5), "kvm_saturation": (32768, 1.5),
    "ovq": (8192, 1.5),
}  # fmt: skip
SPEEDUP_FROM = 32768  # full / kvm_fixed prefill >= 12 is a target for 32K tokens and longer


def ratios(r: BenchResult) -> dict[str, dict[str, Any]]:
    """Ratios of numbers measured in this run, each with its target where one applies: the
    bound ("<= 1.3"), the length it holds from (None: any) and whether it was met (None where
    this length is below it)."""
    s, out = r.settings, {}
    lengths = sorted(s.lengths)
    lo, hi = lengths[0], lengths[-1]

    def add(
        name: str, value: float, target: tuple[str, float] | None = None,
        start: int | None = None, at: int | None = None, note: str = "",
    ) -> None:  # fmt: skip
        """A ratio measured at length `at`, against a target (op "<=" or ">=", bound) holding
        from `start` tokens; `note` follows the bound on the page."""
        if target is None:
            out[name] = {"value": value, "target": None, "from": start, "met": None}
            return
        op, bound = target
        met = None
        if start is None or at is None or at >= start:
            met = value <= bound if op == "<=" else value >= bound
        said = f"{op} {bound:g}{note}"
        out[name] = {"value": value, "target": said, "from": start, "met": met}

    for method in (m for m in s.methods if m in FLOOR_TARGETS):
        start, limit = FLOOR_TARGETS[method]
        for T in lengths:
            m = r.get(method, T)
            name = f"{method} prefill time / floor at {T}"
            add(name, m.prefill_s / m.prefill_floor_s, ("<=", limit), start, T)
    if "ovq" in s.methods:
        _ovq_ratios(r, add)
    if "kvm_fixed" not in s.methods:
        return out
    fixed = {T: r.get("kvm_fixed", T) for T in lengths}
    if len(lengths) > 1:
        prev = lengths[-2]
        add(
            f"kvm_fixed prefill t({hi}) / t({prev})",
            fixed[hi].prefill_s / fixed[prev].prefill_s,
            ("<=", 1.125 * hi / prev),
            note=" (linear)",
        )
        add(
            f"kvm_fixed decode per token t({hi}) / t({lo})",
            fixed[hi].decode_s_per_token / fixed[lo].decode_s_per_token,
            ("<=", 1.5),
        )
    for T in lengths:
        if "full" in s.methods:
            speedup = r.get("full", T).prefill_s / fixed[T].prefill_s
            add(f"full / kvm_fixed prefill at {T}", speedup, (">=", 12), SPEEDUP_FROM, T)
        if "bswa" in s.methods:
            bswa = r.get("bswa", T)
            add(f"kvm_fixed / bswa prefill at {T}", fixed[T].prefill_s / bswa.prefill_s, ("<=", 2))
            slower = fixed[T].decode_s_per_token / bswa.decode_s_per_token
            add(
                f"kvm_fixed / bswa decode per token at {T}",
                slower,
                ("<=", 1.5) if hi == T else None,
            )
    return out


def ovq_state_bound(s: BenchSettings) -> int:
    """Bytes of the largest OVQ state: M centroid rows [keys | values | count], their read
    [mean key | mean value | log count] and a chunk of keys and values."""
    rows = 2 * ovq_config(s).max_centroids * (2 * s.head_dim + 1) + s.chunk_len * 2 * s.head_dim
    return s.batch * s.heads * rows * DTYPES[s.dtype].itemsize


def _ovq_ratios(r: BenchResult, add: Callable[..., None]) -> None:
    """OVQ's state against its bound at every length, and its decode against BSWA's (the
    target at the longest length)."""
    s, hi = r.settings, max(r.settings.lengths)
    bound = ovq_state_bound(s)
    for T in sorted(s.lengths):
        m = r.get("ovq", T)
        add(f"ovq state / its bound at {T}", m.state_bytes / bound, ("<=", 1))
        if "bswa" in s.methods:
            slower = m.decode_s_per_token / r.get("bswa", T).decode_s_per_token
            add(f"ovq / bswa decode per token at {T}", slower, ("<=", 1.5) if T == hi else None)


def run(s: BenchSettings, argv: list[str] | None = None) -> BenchResult:
    """Measure every method at every length, with a progress bar."""
    use_threads(s.threads)
    steps = method_steps(s)
    result = BenchResult(settings=s, provenance=provenance(argv))
    result.provenance["heap_kept"] = keep_freed_heap() if s.keep_heap else False
    for T in tqdm(s.lengths, desc="bench kvm", unit="length"):
        result.measurements += measure({m: steps[m] for m in s.methods}, T, s)
    result.ratios = ratios(result)
    return result
