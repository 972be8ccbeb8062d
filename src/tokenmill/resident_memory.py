"""A process's resident memory, read from ``/proc``, and handing freed heap memory back to
the system (standard library only: both server processes use it)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(pid: int | None = None) -> int | None:
    """``pid``'s (default: this process's) resident set size in bytes
    (``/proc/<pid>/statm``'s second field, in pages), or None when it cannot be read."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


def return_freed_heap() -> None:
    """Hand the heap's free memory back to the system where the C library can
    (glibc's ``malloc_trim``; elsewhere nothing): memory freed in bulk, as a model's
    loading frees its intermediate copies, otherwise stays resident in the heap."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)
