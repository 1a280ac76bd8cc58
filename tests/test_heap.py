"""`longkv.heap`: freed heap pages go back to the OS when released, and loading a tokenizer
releases them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from longkv.heap import libc_function
from longkv.models import pretrained
from longkv.train.tokenizer import gpt2_tokenizer

# heap blocks (below any mmap threshold), 120 MB, filled, then all but the last freed (the
# heap's top cannot shrink by itself); run in a fresh process, whose heap no earlier test
# fragmented: the resident set before and after the release, in bytes
RELEASE = """
import ctypes
from longkv.bench.process import status_bytes
from longkv.heap import libc_function, release_freed_heap
malloc, free = libc_function("malloc"), libc_function("free")
malloc.restype, free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
blocks = [malloc(2000) for _ in range(60_000)]
for block in blocks:
    ctypes.memset(block, 1, 2000)
for block in blocks[:-1]:
    free(block)
before = status_bytes("VmRSS")
release_freed_heap()
print(before, status_bytes("VmRSS"))
"""


@pytest.mark.skipif(libc_function("malloc_trim") is None, reason="needs glibc's malloc_trim")
def test_released_heap_pages_leave_the_resident_set() -> None:
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    before, after = map(int, out.split())
    assert before - after > 0.8 * 2000 * 60_000, (before, after)


def test_loading_a_tokenizer_releases_what_its_loading_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpt2_tokenizer().save_pretrained(tmp_path)
    calls: list[str] = []
    monkeypatch.setattr(pretrained, "release_freed_heap", lambda: calls.append("released"))
    tokenizer = pretrained.load_tokenizer(str(tmp_path))
    assert calls == ["released"] and tokenizer("x")["input_ids"] == [87]
