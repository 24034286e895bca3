"""Keep glibc's malloc from holding memory Python has freed, so RSS follows what Python holds.

Under churn the exporter's Python objects barely grow (benchmarks/soak.py measures it:
docs/reliability.md, "Memory under churn: the soak"), but glibc keeps
what Python frees in per-thread arenas (up to 8 per core by default, one per worker thread
that allocates) and returns it to the kernel only from the top of each heap, so resident
memory crept upwards in steps as the arenas fragmented. Two standard glibc controls stop
that: ``mallopt(M_ARENA_MAX, 2)`` before the worker threads start (what
``MALLOC_ARENA_MAX=2`` does) with a fixed ``M_MMAP_THRESHOLD`` (mallopt(3)), and
``malloc_trim(0)`` now and then, which since glibc 2.8 gives back free pages from the
middle of every arena too (malloc_trim(3)).
Elsewhere (musl, macOS) both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

M_ARENA_MAX = -8  # malloc.h
M_MMAP_THRESHOLD = -3
ARENAS = 2
# Blocks this big or bigger get pages of their own, given back when freed. Setting it
# also stops glibc raising the threshold each time such a block is freed (up to 32 MiB),
# which put each cycle's ~130 KiB exposition strings in the arenas to fragment them.
MMAP_THRESHOLD = 128 * 1024


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    return libc


_LIBC = _glibc()


def limit_arenas() -> None:
    """Two malloc arenas and a fixed mmap threshold, unless the environment already sets
    them (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_); call before threads start."""
    if _LIBC is None:
        return
    for variable, option, value in (
        ("MALLOC_ARENA_MAX", M_ARENA_MAX, ARENAS),
        ("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    ):
        if variable not in os.environ and not _LIBC.mallopt(option, value):
            log.debug("mallopt(%d, %d) refused", option, value)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def usage() -> dict[str, int] | None:
    """Bytes malloc has handed out and still holds free (mallinfo2(3), glibc 2.33+), to
    tell a leak (in use grows) from fragmentation (free grows); None where unknown."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    _LIBC.mallinfo2.restype = _Mallinfo2
    info = _LIBC.mallinfo2()
    return {"in_use": info.uordblks + info.hblkhd, "free": info.fordblks}


def trim() -> None:
    """Give the kernel back the free pages glibc holds (a few ms on a 100 MiB heap)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
