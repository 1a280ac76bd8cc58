"""The matmul work each attention needs, counted from its definition, and the rate at which
this machine runs matmuls of the same shapes: together the floor a benchmark compares with.

Counted are the multiply-adds the math asks for (2 FLOPs each): q.k and p.v over every
(query, visible key) pair, and KVM's similarity of each leaving token to the slots (spec
section 5) or OVQ's of each committed token to the centroids; masked pairs, softmax, norms,
the count bias and copies are not. A run at its floor would spend
all its time in matmuls at the measured rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from longkv.kvm.config import KVMConfig, desired_state_len
from longkv.ovq.config import OVQConfig


@dataclass(frozen=True)
class Work:
    """Matmul FLOPs of a prefill of T tokens and of the decode steps after it, and the mean
    number of keys a query sees in each (the shape the GEMM rate is measured on)."""

    prefill_flops: float
    prefill_keys: float
    decode_flops: float  # per decoded token, updates included
    decode_keys: float


@dataclass(frozen=True)
class Shape:
    """Batch B, query heads H, key/value heads Hkv, head dim D."""

    B: int
    H: int
    Hkv: int
    D: int

    def attention(self, pairs: float) -> float:
        """FLOPs of q.k and p.v over `pairs` (query, key) pairs of every query head."""
        return 4.0 * self.B * self.H * self.D * pairs

    def similarity(self, pairs: float) -> float:
        """FLOPs of the token-slot similarities over `pairs` of every key/value head."""
        return 2.0 * self.B * self.Hkv * self.D * pairs


def kvm_work(config: KVMConfig, T: int, n_decode: int, shape: Shape) -> Work:
    """The work of `kvm_attention` over tokens [0, T) in one call, then n_decode more one at a
    time: per query, its slots (from chunk N on) and its window keys; per update that merges,
    the leaving block's similarity to the slots before it and to the ones it founds."""
    C, N, W = config.chunk_len, config.window_chunks, config.window_len
    S, cov = 0, 0  # slots; tokens [0, cov) they summarise
    pairs = [0.0, 0.0]  # (prefill, decode): query-key pairs, token-slot similarities
    sims = [0.0, 0.0]
    for p in range(T + n_decode):
        part = int(p >= T)
        c = p // C
        if p < C:
            S, cov = p + 1, p + 1
        lo = max(0, (c - N + 1) * C)
        if c >= N and cov < lo:
            target = desired_state_len(config, W + cov, cov + C, S)
            n = min(max(target - S, 0), C)
            if n < C:
                sims[part] += C * (S + n)
            S, cov = S + n, lo
        pairs[part] += (S if c >= N else 0) + p - lo + 1
    return _work(shape, pairs, sims, T, n_decode)


def ovq_work(config: OVQConfig, T: int, n_decode: int, shape: Shape) -> Work:
    """The work of `ovq_attention` over tokens [0, T) in one call, then n_decode more one at a
    time: per query, the centroids visible in its chunk and its chunk up to itself; per complete
    chunk, its tokens' similarity to the centroids before it (the first chunk: to its first
    token)."""
    C = config.chunk_len
    pairs, sims = [0.0, 0.0], [0.0, 0.0]
    for p in range(T + n_decode):
        part, start = int(p >= T), p // C * C
        pairs[part] += config.size(start) + p - start + 1
        if p % C == C - 1:
            sims[part] += C * max(config.size(start), 1)
    return _work(shape, pairs, sims, T, n_decode)


def window_work(lo_of: Callable[[int], int], T: int, n_decode: int, shape: Shape) -> Work:
    """The work of an attention whose query at p sees keys [max(0, lo_of(p)), p]."""
    pairs = [0.0, 0.0]
    for p in range(T + n_decode):
        pairs[int(p >= T)] += p - max(0, lo_of(p)) + 1
    return _work(shape, pairs, [0.0, 0.0], T, n_decode)


def _work(shape: Shape, pairs: list[float], sims: list[float], T: int, n: int) -> Work:
    flops = [shape.attention(pairs[i]) + shape.similarity(sims[i]) for i in range(2)]
    n = max(n, 1)
    return Work(flops[0], pairs[0] / T, flops[1] / n, pairs[1] / n)


def gemm_rate(
    shape: Shape, rows: int, keys: float, device: torch.device, dtype: torch.dtype, repeats: int
) -> float:
    """FLOP/s of the two matmuls of attention, q.k then p.v, for `rows` grouped queries of
    every key/value head against round(keys) keys: the best of `repeats` timed pairs."""
    L = max(1, round(keys))
    G = shape.H // shape.Hkv
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(shape.B, shape.Hkv, G * rows, shape.D, generator=g, device=device, dtype=dtype)
    k = torch.randn(shape.B, shape.Hkv, L, shape.D, generator=g, device=device, dtype=dtype)
    flops = 4.0 * shape.B * shape.Hkv * G * rows * L * shape.D
    best = float("inf")
    with torch.no_grad():
        for i in range(repeats + 2):  # two warm-up pairs
            _sync(device)
            t0 = time.perf_counter()
            (q @ k.transpose(-1, -2)) @ k
            _sync(device)
            if i >= 2:
                best = min(best, time.perf_counter() - t0)
    return flops / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
