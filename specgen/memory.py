"""Giving freed memory back to the system after a large one-off step.

glibc's malloc keeps what a thread freed in that thread's arena for reuse; after a conversion
dequantized a model on a thread pool, or after int8 packing freed its copies, the process
held on to more than a gigabyte it would never reuse (1.15 GB after converting the 0.5B
draft), which showed in the first run's peak RSS. `malloc_trim(0)` returns it. Elsewhere
(musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_LIBC = ctypes.util.find_library("c")


def release_freed() -> None:
    """Return freed heap memory to the system where the C library can (glibc's malloc_trim)."""
    try:
        trim = ctypes.CDLL(_LIBC).malloc_trim if _LIBC else None
    except (OSError, AttributeError):
        return
    if trim is not None:
        trim(0)
