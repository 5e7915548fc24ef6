"""The CLI process's C allocator told to keep the memory tensors free, so the next tensor of that
size reuses it instead of asking the kernel for fresh pages.

glibc's ``malloc`` serves a block over its mmap threshold (128 KiB, rising to at most 32 MiB as
such blocks are freed) with its own ``mmap`` and hands it back on ``free``: every stacked
candidate grid, replay activation and float64 quotient of a search is a fresh mapping whose
every page faults in zeroed on first touch. An AWQ run on tiny-llama faults in about 22 GB that
way, a tenth of its time in the kernel. With the threshold and the heap's trim threshold at
``KEPT_BYTES``, freed blocks stay in the heap for the next ones: the same run faults a third as
often (5.8M → 2.0M minor faults, the kernel's share of its time halved) for a resident peak about
5% higher (3.18 → 3.33 GB: heap blocks of one size do not always fit the next request of that
size, ``posix_memalign``'s padding). The app, a long-lived server, keeps glibc's defaults.

A stage whose few large blocks of several sizes come and go asks for glibc's own rule back while it
runs (``large_blocks_mapped``): a GPTQ sweep's layer-sized copies and ``(in, in)`` matrices split
and strand one another's freed blocks in a heap that keeps them (2.3 GB resident for 1.5 GB live at
a 4096 × 11008 ``down_proj``; every GPTQ sweep, the analysis's and the one propagation or the
checkpoint makes again, 1.8 GB above the live peak when one was left out), for a few page faults
a block against seconds of sweep. Such stages nest (a sweep inside a layer's rows): the threshold
goes back when the outermost ends.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager

KEPT_BYTES = 1 << 30
"""Blocks up to this size come from the heap, and up to this much freed heap top is kept."""

LARGE_BYTES = 64 << 20
"""Inside ``large_blocks_mapped``, blocks from this size are mapped for themselves and unmapped when freed."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_kept_by: ctypes.CDLL | None = None
"""The C library ``keep_freed_memory`` changed (None: nothing was changed in this process)."""
_mapped_depth = 0
"""How many ``large_blocks_mapped`` are open (the process's threshold is LARGE_BYTES while any is)."""


def keep_freed_memory() -> bool:
    """Tell glibc's allocator to keep freed blocks (``mallopt``); False where the C library is not
    glibc (nothing changed there)."""
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return False
        libc = ctypes.CDLL("libc.so.6")
    except (ValueError, OSError):
        return False
    global _kept_by
    kept = libc.mallopt(_M_MMAP_THRESHOLD, KEPT_BYTES) == 1
    kept = libc.mallopt(_M_TRIM_THRESHOLD, KEPT_BYTES) == 1 and kept
    _kept_by = libc if kept else None
    return kept


@contextmanager
def large_blocks_mapped() -> Iterator[None]:
    """Inside, blocks of ``LARGE_BYTES`` and more come from mappings of their own and go back to the
    system when freed; after the outermost, ``keep_freed_memory``'s threshold again. Nothing changes in a process
    that did not keep freed memory (the app keeps glibc's own adaptive threshold)."""
    global _mapped_depth
    if _kept_by is None:
        yield
        return
    if _mapped_depth == 0:
        _kept_by.mallopt(_M_MMAP_THRESHOLD, LARGE_BYTES)
    _mapped_depth += 1
    try:
        yield
    finally:
        _mapped_depth -= 1
        if _mapped_depth == 0:
            _kept_by.mallopt(_M_MMAP_THRESHOLD, KEPT_BYTES)
