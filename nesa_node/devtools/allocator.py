"""Steady memory for benchmarks: glibc returns freed blocks above its mmap threshold to the system at once, so a
benchmark that allocates tens of MB a step pays a page fault per 4 KiB on every step, which no long-running node
pays. `steady_allocator` keeps such blocks for reuse."""

from __future__ import annotations

import ctypes
import ctypes.util


def steady_allocator() -> str:
    """Make glibc reuse freed memory for blocks up to 32 MiB and never trim; says what was done."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        applied = libc.mallopt(m_mmap_threshold, 32 << 20) == 1 and libc.mallopt(m_trim_threshold, 1 << 30) == 1
    except (OSError, AttributeError):
        applied = False
    return "glibc: mmap threshold 32 MiB, no trimming" if applied else "unchanged (not glibc)"


__all__ = ["steady_allocator"]
