"""Peak memory of one call: CUDA allocator statistics, or the resident-set high-water mark.

Measuring on CPU changes process-wide state (glibc's allocator settings, the kernel's RSS
high-water mark), so it lives here, in the benchmarks, and nothing outside `longkv.bench` uses
it: a plain `kv_fold` or `streaming_llm` leaves the process as it found it.
"""

from __future__ import annotations

import ctypes
import gc
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from longkv.bench.process import status_bytes
from longkv.heap import libc_function, release_freed_heap

R = TypeVar("R")
_CLEAR_REFS = Path("/proc/self/clear_refs")


_heap_kept = False
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8


def _share_one_arena() -> None:
    """Stop glibc from giving threads arenas of their own (M_ARENA_MAX 1).

    With an arena per torch worker thread, where a block lands depends on scheduling, and the
    resident high-water mark of the same call moved from run to run with 2 threads but not
    with 1. Arenas made before the call stay.
    """
    mallopt = libc_function("mallopt")
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, 1)


def keep_freed_heap(keep: bool = True) -> bool:
    """Make glibc keep freed memory for reuse (or not); returns whether it could be set.

    keep=True: large temporaries freed in one step are reused in the next instead of being
    returned to the OS and faulted in again, like a caching allocator, so CPU timings measure
    arithmetic rather than page faults (M_MMAP_THRESHOLD 1 GiB, M_TRIM_THRESHOLD 2 GiB).
    keep=False: every block of a page (4 KiB) or more is mapped and unmapped on its own, so the
    resident set follows live memory (what `peak_memory` reads): a call whose blocks were all
    served from pages the heap already held would raise no high-water mark at all, which a
    threshold of 128 KiB allowed for a call of small tensors.
    """
    global _heap_kept
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return False
    mmap, trim = (2**30, 2**31) if keep else (2**12, 2**17)
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap)) and bool(mallopt(_M_TRIM_THRESHOLD, trim))
    _heap_kept = keep and ok
    return ok


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (glibc >= 2.33): ten size_t counters."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _live_heap_bytes() -> int | None:
    """Bytes glibc's malloc has handed out and not had back, over every arena: in heap chunks
    (uordblks) and in mapped blocks (hblkhd); None without mallinfo2."""
    mallinfo2 = libc_function("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _LiveHeapPeak:
    """The largest rise of `_live_heap_bytes` above `base`, over the samples taken."""

    def __init__(self) -> None:
        self.base = _live_heap_bytes()
        self.rise = 0

    def sample(self) -> None:
        now = _live_heap_bytes()
        if now is not None and self.base is not None:
            self.rise = max(self.rise, now - self.base)


def cpu_peak_supported() -> bool:
    """Linux lets a process reset its RSS high-water mark (clear_refs value 5)."""
    try:
        _CLEAR_REFS.write_text("5")
        status_bytes("VmHWM")
    except (OSError, RuntimeError):
        return False
    return True


def load_weights(module: torch.nn.Module) -> None:
    """Read every parameter and buffer once, so weights mapped lazily from a file are resident.

    transformers maps safetensors weights from disk and the kernel reads a page in on its first
    use; without this, the first forward after loading counts the weights it touches (the whole
    model, for a full forward) as its own memory. Each tensor is read by its maximum, which
    allocates nothing the tensor's size (a sum of int8 weights widens them to int64).
    """
    with torch.inference_mode():
        for t in (*module.parameters(), *module.buffers()):
            if t.device.type == "cpu" and t.numel():
                (t.view(torch.uint8) if t.dtype == torch.bool else t).amax()


def peak_memory(fn: Callable[[], R], device: torch.device) -> tuple[R, int | None]:
    """Run fn and return (its result, peak bytes allocated above the level before the call).

    CUDA: torch.cuda.max_memory_allocated. CPU: the larger of two rises. The rise of the
    resident-set high-water mark (VmHWM, reset first, free heap returned first and again every
    5 ms while fn runs, `_trim_until`) sees every page fn touched, but a rise of the resident
    set is not a peak: under memory pressure the kernel takes the process's file pages (its
    libraries' code) and swaps anonymous ones while fn runs, and the set can end no higher than
    it began although fn allocated and kept memory. The largest rise of the bytes glibc's
    malloc has handed out (`_live_heap_bytes`, sampled with every trim and once fn returns)
    does not depend on what is resident: it cannot read 0 for an fn that keeps what it
    allocated (a training step's gradients, a fold's cache). None where neither can be read.
    On CPU the process's threads share one allocator arena from the first call on
    (`_share_one_arena`), and Python's cyclic garbage is collected before the call and not
    during it: a collection inside fn frees what earlier work left in reference cycles
    (hundreds of MiB after a model run) and would hide fn's rise.
    When the process keeps freed heap (`keep_freed_heap`, the benchmarks), glibc maps each large
    block on its own for the call, so the rise follows live memory; otherwise its trim and mmap
    thresholds are left alone and the rise may include memory it keeps for reuse.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - before
    if device.type != "cpu" or not cpu_peak_supported():
        return fn(), None
    kept, collecting = _heap_kept, gc.isenabled()
    done = threading.Event()
    trimmer: threading.Thread | None = None
    try:
        if kept:
            keep_freed_heap(False)
        _share_one_arena()
        gc.collect()
        gc.disable()
        live = _LiveHeapPeak()
        trimmer = threading.Thread(target=_trim_until, args=(done, live), daemon=True)
        trimmer.start()
        release_freed_heap()
        _CLEAR_REFS.write_text("5")
        before = status_bytes("VmRSS")
        result = fn()
        live.sample()
        return result, max(0, status_bytes("VmHWM") - before, live.rise)
    finally:
        done.set()
        if trimmer is not None and trimmer.is_alive():
            trimmer.join()
        if collecting:
            gc.enable()
        if kept:
            keep_freed_heap(True)


def _trim_until(done: threading.Event, live: _LiveHeapPeak, every_s: float = 0.005) -> None:
    """Return freed heap pages to the OS (and sample the live heap bytes, `live`) every
    `every_s` seconds until `done` is set.

    glibc serves a request from the free chunks an earlier call left in its heap before it maps
    new memory, and a freed chunk's pages stay resident until a trim; without this the
    high-water mark counts every page of that free pool the call touched, not what it held.
    """
    while not done.wait(every_s):
        live.sample()
        release_freed_heap()
