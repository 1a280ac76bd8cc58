"""glibc's allocator, where the process has it: a function of libc by name, and handing the
pages it holds free back to the OS.

Loading a tokenizer parses its JSON (Gemma 3's: 262144 tokens and their merges) into
structures most of which are freed again, in blocks small enough that the heap keeps them: the
process stays that much larger, and tensors allocated later (mapped blocks of their own) never
reuse those pages. `release_freed_heap` after such a step gives them back; it changes no
allocator setting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def libc_function(name: str) -> Callable[..., int] | None:
    """The C library's function `name`, None where there is no such library or function."""
    libc_name = ctypes.util.find_library("c")  # runs ldconfig: look it up once
    return getattr(ctypes.CDLL(libc_name), name, None) if libc_name else None


def release_freed_heap() -> None:
    """Return freed heap pages to the OS (glibc's malloc_trim; nothing elsewhere)."""
    trim = libc_function("malloc_trim")
    if trim is not None:
        trim(0)
