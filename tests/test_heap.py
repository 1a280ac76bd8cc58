"""`longkv.heap`: freed heap pages go back to the OS when released, and loading a tokenizer
releases them."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from longkv.bench.process import status_bytes
from longkv.heap import libc_function, release_freed_heap
from longkv.models import pretrained
from longkv.train.tokenizer import gpt2_tokenizer

BLOCK, BLOCKS = 2000, 60_000  # heap blocks (below any mmap threshold): 120 MB


@pytest.mark.skipif(libc_function("malloc_trim") is None, reason="needs glibc's malloc_trim")
def test_released_heap_pages_leave_the_resident_set() -> None:
    malloc, free = libc_function("malloc"), libc_function("free")
    assert malloc is not None and free is not None
    malloc.restype, free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    blocks = [malloc(BLOCK) for _ in range(BLOCKS)]
    for block in blocks:
        ctypes.memset(block, 1, BLOCK)
    for block in blocks[:-1]:  # the last one held: the heap's top cannot shrink by itself
        free(block)
    before = status_bytes("VmRSS")
    release_freed_heap()
    after = status_bytes("VmRSS")
    free(blocks[-1])
    assert before - after > 0.8 * BLOCK * BLOCKS, (before, after)


def test_loading_a_tokenizer_releases_what_its_loading_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpt2_tokenizer().save_pretrained(tmp_path)
    calls: list[str] = []
    monkeypatch.setattr(pretrained, "release_freed_heap", lambda: calls.append("released"))
    tokenizer = pretrained.load_tokenizer(str(tmp_path))
    assert calls == ["released"] and tokenizer("x")["input_ids"] == [87]
